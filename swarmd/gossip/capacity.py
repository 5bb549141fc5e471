"""What this node can offer: GPUs from NVML, CPU and memory from psutil.

Rules:
- No GPU (no driver, no library, no device) is a normal state: ``gpus`` is empty and
  ``gpu_backend`` says "none". The collector never raises from ``sample()``.
- Values cross the wire as plain maps whose keys are the field names; ``from_wire`` checks a
  peer's map field by field and raises ``ValueError`` naming the first bad one.
- Load jitters; a record is re-published only for a change a scheduler would act on
  (``significant_change``), so an idle swarm is quiet.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

MAX_GPUS = 64  # more than any single machine ships with; bounds a peer's record

# Thresholds of a significant change: below them the difference is load noise.
GPU_MEM_FRACTION = 0.05
MEM_FRACTION = 0.05
CPU_FRACTION = 0.10
CPU_MIN = 0.5


@dataclass(frozen=True, slots=True, kw_only=True)
class Gpu:
    index: int
    name: str
    uuid: str
    memory_total_mb: int
    memory_free_mb: int
    utilization_pct: int
    compute_capability: str  # "8.0"; empty when the driver does not say


@dataclass(frozen=True, slots=True, kw_only=True)
class Resources:
    cpu_count: int
    cpu_free: float  # cores' worth of idle CPU
    memory_total_mb: int
    memory_free_mb: int
    gpus: tuple[Gpu, ...] = ()

    def to_wire(self) -> dict[str, Any]:
        wire = dataclasses.asdict(self)
        wire["gpus"] = [dataclasses.asdict(g) for g in self.gpus]
        return wire

    @classmethod
    def from_wire(cls, data: Any) -> Resources:
        if not isinstance(data, dict):
            raise ValueError(f"resources: expected a map, got {type(data).__name__}")
        gpus_raw = data.get("gpus", [])
        if not isinstance(gpus_raw, list):
            raise ValueError(f"resources.gpus: expected a list, got {type(gpus_raw).__name__}")
        if len(gpus_raw) > MAX_GPUS:
            raise ValueError(f"resources.gpus: {len(gpus_raw)} GPUs, at most {MAX_GPUS}")
        gpus = []
        for i, g in enumerate(gpus_raw):
            where = f"resources.gpus[{i}]"
            if not isinstance(g, dict):
                raise ValueError(f"{where}: expected a map, got {type(g).__name__}")
            gpus.append(Gpu(
                index=_count(g, "index", where),
                name=_text(g, "name", where),
                uuid=_text(g, "uuid", where),
                memory_total_mb=_count(g, "memory_total_mb", where),
                memory_free_mb=_count(g, "memory_free_mb", where),
                utilization_pct=_count(g, "utilization_pct", where, limit=100),
                compute_capability=_text(g, "compute_capability", where),
            ))
        cpu_count = _count(data, "cpu_count", "resources")
        cpu_free = data.get("cpu_free")
        if isinstance(cpu_free, bool) or not isinstance(cpu_free, (int, float)) \
                or not 0 <= cpu_free <= max(cpu_count, 1):
            raise ValueError(f"resources.cpu_free: expected a number in [0, cpu_count], got {cpu_free!r}")
        return cls(
            cpu_count=cpu_count,
            cpu_free=float(cpu_free),
            memory_total_mb=_count(data, "memory_total_mb", "resources"),
            memory_free_mb=_count(data, "memory_free_mb", "resources"),
            gpus=tuple(gpus),
        )

    def significant_change(self, other: Resources) -> bool:
        """Whether ``self`` differs from ``other`` (the advertised value) enough to re-publish."""
        if [g.uuid for g in self.gpus] != [g.uuid for g in other.gpus]:
            return True
        for mine, theirs in zip(self.gpus, other.gpus):
            if abs(mine.memory_free_mb - theirs.memory_free_mb) > GPU_MEM_FRACTION * mine.memory_total_mb:
                return True
        if self.cpu_count != other.cpu_count or self.memory_total_mb != other.memory_total_mb:
            return True
        if abs(self.cpu_free - other.cpu_free) >= max(CPU_MIN, CPU_FRACTION * self.cpu_count):
            return True
        return abs(self.memory_free_mb - other.memory_free_mb) > MEM_FRACTION * self.memory_total_mb

    def summary(self) -> str:
        parts = []
        if self.gpus:
            names: dict[str, int] = {}
            for g in self.gpus:
                names[g.name] = names.get(g.name, 0) + 1
            parts.append(", ".join(f"{n}× {name}" for name, n in names.items()))
        parts.append(f"cpu {self.cpu_free:.1f}/{self.cpu_count} free")
        parts.append(f"mem {self.memory_free_mb / 1024:.1f}/{self.memory_total_mb / 1024:.1f} GiB free")
        return "; ".join(parts)


def _count(data: dict[str, Any], name: str, where: str, limit: int = 1 << 40) -> int:
    value = data.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= limit:
        raise ValueError(f"{where}.{name}: expected an integer in [0, {limit}], got {value!r}")
    return value


def _text(data: dict[str, Any], name: str, where: str) -> str:
    value = data.get(name)
    if not isinstance(value, str) or len(value) > 128 or not value.isprintable():  # people read it (swarmctl peers)
        raise ValueError(f"{where}.{name}: expected printable text of at most 128 characters, got {value!r}")
    return value


class Collector:
    """Samples this machine. ``nvml`` is the ``pynvml`` module (tests pass a fake one)."""

    def __init__(self, nvml: Any = None) -> None:
        self._nvml = nvml
        self.gpu_backend = "none"
        import psutil  # here, not at the top: the value types above are shared with sans-IO cores

        psutil.cpu_percent(interval=None)  # primes the counter; the first reading is meaningless
        if nvml is None:
            try:
                import pynvml as nvml  # nvidia-ml-py
            except ImportError:
                return
        try:
            nvml.nvmlInit()
        except nvml.NVMLError:
            return  # no driver or no device: a CPU-only provider
        self._nvml = nvml
        self.gpu_backend = "nvml"

    def sample(self) -> Resources:
        import psutil

        vm = psutil.virtual_memory()
        cpus = psutil.cpu_count() or 1
        busy = psutil.cpu_percent(interval=None) / 100.0
        return Resources(
            cpu_count=cpus,
            cpu_free=round(min(cpus, max(0.0, cpus * (1.0 - busy))), 2),
            memory_total_mb=vm.total >> 20,
            memory_free_mb=vm.available >> 20,
            gpus=self._gpus(),
        )

    def _gpus(self) -> tuple[Gpu, ...]:
        if self.gpu_backend != "nvml":
            return ()
        nvml = self._nvml
        try:
            gpus = []
            for index in range(nvml.nvmlDeviceGetCount()):
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                mem = nvml.nvmlDeviceGetMemoryInfo(handle)
                try:
                    util = nvml.nvmlDeviceGetUtilizationRates(handle).gpu
                except nvml.NVMLError:
                    util = 0  # some devices (MIG slices) do not report it
                try:
                    major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
                    capability = f"{major}.{minor}"
                except nvml.NVMLError:
                    capability = ""
                gpus.append(Gpu(
                    index=index,
                    name=_str(nvml.nvmlDeviceGetName(handle)),
                    uuid=_str(nvml.nvmlDeviceGetUUID(handle)),
                    memory_total_mb=int(mem.total) >> 20,
                    memory_free_mb=int(mem.free) >> 20,
                    utilization_pct=int(util),
                    compute_capability=capability,
                ))
            return tuple(gpus)
        except nvml.NVMLError:
            return ()  # a driver hiccup: advertise no GPU this round rather than crash

    def close(self) -> None:
        if self.gpu_backend == "nvml":
            try:
                self._nvml.nvmlShutdown()
            except self._nvml.NVMLError:
                pass
            self.gpu_backend = "none"


def _str(value: str | bytes) -> str:
    # nvidia-ml-py returned bytes before 11.5 and str after
    return value.decode() if isinstance(value, bytes) else value
