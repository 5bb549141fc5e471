import copy
import dataclasses
from types import SimpleNamespace

import msgpack
import pytest

from swarmd.gossip.capacity import MAX_GPUS, Collector, Gpu, Resources

A100 = Gpu(index=0, name="NVIDIA A100-SXM4-80GB", uuid="GPU-aaaa", memory_total_mb=80000,
           memory_free_mb=40000, utilization_pct=50, compute_capability="8.0")
H100 = Gpu(index=1, name="NVIDIA H100 80GB HBM3", uuid="GPU-bbbb", memory_total_mb=80000,
           memory_free_mb=40000, utilization_pct=0, compute_capability="9.0")
BASE = Resources(cpu_count=8, cpu_free=4.0, memory_total_mb=16000, memory_free_mb=8000, gpus=(A100, H100))


def wire_copy(res: Resources = BASE) -> dict:
    return copy.deepcopy(res.to_wire())


def test_round_trip_through_msgpack():
    data = msgpack.unpackb(msgpack.packb(BASE.to_wire(), use_bin_type=True), raw=False)
    assert Resources.from_wire(data) == BASE


def test_round_trip_without_gpus():
    res = dataclasses.replace(BASE, gpus=())
    assert res.to_wire()["gpus"] == []
    assert Resources.from_wire(res.to_wire()) == res


def test_integer_cpu_free_reads_as_float():
    data = wire_copy()
    data["cpu_free"] = 4
    res = Resources.from_wire(data)
    assert res.cpu_free == 4.0 and isinstance(res.cpu_free, float)


def test_missing_gpus_means_none():
    data = wire_copy()
    del data["gpus"]
    assert Resources.from_wire(data).gpus == ()


def test_unknown_fields_are_ignored():
    data = wire_copy()
    data["future_field"] = {"x": 1}
    data["gpus"][0]["temperature_c"] = 60
    assert Resources.from_wire(data) == BASE


def _set(path, value):
    def mutate(data):
        *parents, last = path
        for p in parents:
            data = data[p]
        data[last] = value
    return mutate


def _delete(path):
    def mutate(data):
        *parents, last = path
        for p in parents:
            data = data[p]
        del data[last]
    return mutate


@pytest.mark.parametrize("mutate, where", [
    (_set(["gpus", 1, "memory_free_mb"], -1), "resources.gpus[1].memory_free_mb"),
    (_set(["gpus", 0, "memory_total_mb"], True), "resources.gpus[0].memory_total_mb"),
    (_set(["gpus", 0, "memory_total_mb"], (1 << 40) + 1), "resources.gpus[0].memory_total_mb"),
    (_set(["gpus", 1, "index"], 1.0), "resources.gpus[1].index"),
    (_set(["gpus", 0, "utilization_pct"], 101), "resources.gpus[0].utilization_pct"),
    (_set(["gpus", 0, "name"], "x" * 129), "resources.gpus[0].name"),
    (_set(["gpus", 0, "uuid"], 5), "resources.gpus[0].uuid"),
    (_set(["gpus", 1, "uuid"], b"GPU-bbbb"), "resources.gpus[1].uuid"),
    (_delete(["gpus", 1, "compute_capability"]), "resources.gpus[1].compute_capability"),
    (_set(["gpus", 1], "a gpu"), "resources.gpus[1]: expected a map"),
    (_set(["gpus"], {"0": {}}), "resources.gpus: expected a list"),
    (_set(["cpu_count"], -1), "resources.cpu_count"),
    (_set(["cpu_count"], True), "resources.cpu_count"),
    (_set(["cpu_count"], 1 << 41), "resources.cpu_count"),
    (_delete(["cpu_count"]), "resources.cpu_count"),
    (_set(["memory_total_mb"], (1 << 40) + 1), "resources.memory_total_mb"),
    (_set(["memory_free_mb"], 1.5), "resources.memory_free_mb"),
    (_set(["memory_free_mb"], "8000"), "resources.memory_free_mb"),
    (_set(["cpu_free"], True), "resources.cpu_free"),
    (_set(["cpu_free"], -0.1), "resources.cpu_free"),
    (_set(["cpu_free"], 8.5), "resources.cpu_free"),  # more idle cores than cores
    (_set(["cpu_free"], float("nan")), "resources.cpu_free"),
    (_set(["cpu_free"], float("inf")), "resources.cpu_free"),
    (_set(["cpu_free"], "4"), "resources.cpu_free"),
    (_delete(["cpu_free"]), "resources.cpu_free"),
])
def test_from_wire_names_the_bad_field(mutate, where):
    data = wire_copy()
    mutate(data)
    with pytest.raises(ValueError) as err:
        Resources.from_wire(data)
    assert str(err.value).startswith(where), str(err.value)


@pytest.mark.parametrize("data", [None, [], "resources", 5])
def test_from_wire_wants_a_map(data):
    with pytest.raises(ValueError, match=r"^resources: expected a map"):
        Resources.from_wire(data)


def _gpus(n):
    return [dict(dataclasses.asdict(A100), index=i, uuid=f"GPU-{i}") for i in range(n)]


def test_at_most_max_gpus():
    data = wire_copy()
    data["gpus"] = _gpus(MAX_GPUS)
    assert len(Resources.from_wire(data).gpus) == MAX_GPUS
    data["gpus"] = _gpus(MAX_GPUS + 1)
    with pytest.raises(ValueError, match=rf"^resources.gpus: {MAX_GPUS + 1} GPUs, at most {MAX_GPUS}"):
        Resources.from_wire(data)


def _gpu_free(res, i, delta):
    gpus = list(res.gpus)
    gpus[i] = dataclasses.replace(gpus[i], memory_free_mb=gpus[i].memory_free_mb + delta)
    return dataclasses.replace(res, gpus=tuple(gpus))


def _r(**changes):
    return dataclasses.replace(BASE, **changes)


SMALL = Resources(cpu_count=2, cpu_free=1.0, memory_total_mb=4000, memory_free_mb=2000)
TEN = Resources(cpu_count=10, cpu_free=4.0, memory_total_mb=16000, memory_free_mb=8000)


# BASE: 8 cores, 16000 MB, two 80000 MB GPUs. Thresholds: GPU 4000 MB (5 % of total),
# CPU max(0.5, 0.8) cores, memory 800 MB (5 % of total).
@pytest.mark.parametrize("new, old, significant", [
    (BASE, BASE, False),
    # GPU set
    (_r(gpus=(A100,)), BASE, True),
    (BASE, _r(gpus=(A100,)), True),
    (_r(gpus=(H100, A100)), BASE, True),  # a different order is a different set of indices
    (_r(gpus=(A100, dataclasses.replace(H100, uuid="GPU-cccc"))), BASE, True),
    (_r(gpus=()), BASE, True),
    # GPU free memory: strictly more than 5 % of that GPU's total
    (_gpu_free(BASE, 1, -3999), BASE, False),
    (_gpu_free(BASE, 1, -4000), BASE, False),
    (_gpu_free(BASE, 1, -4001), BASE, True),
    (_gpu_free(BASE, 0, +4001), BASE, True),
    (_r(gpus=(dataclasses.replace(A100, utilization_pct=100), H100)), BASE, False),  # load jitter
    # CPU: at least max(0.5 cores, 10 % of the cores)
    (_r(cpu_free=4.7), BASE, False),
    (_r(cpu_free=3.3), BASE, False),
    (_r(cpu_free=4.9), BASE, True),
    (_r(cpu_free=3.1), BASE, True),
    (dataclasses.replace(TEN, cpu_free=4.9), TEN, False),
    (dataclasses.replace(TEN, cpu_free=5.0), TEN, True),  # 10 % of 10 cores, inclusive
    (dataclasses.replace(SMALL, cpu_free=1.25), SMALL, False),  # 10 % of 2 is 0.2: the 0.5 floor applies
    (dataclasses.replace(SMALL, cpu_free=1.5), SMALL, True),
    (_r(cpu_count=16, cpu_free=4.0), BASE, True),
    # memory: strictly more than 5 % of the total
    (_r(memory_free_mb=8800), BASE, False),
    (_r(memory_free_mb=7200), BASE, False),
    (_r(memory_free_mb=8801), BASE, True),
    (_r(memory_free_mb=7199), BASE, True),
    (_r(memory_total_mb=16001), BASE, True),
    # small jitter everywhere at once is still noise
    (_r(cpu_free=4.3, memory_free_mb=8500, gpus=_gpu_free(_gpu_free(BASE, 0, 1000), 1, -2000).gpus), BASE, False),
])
def test_significant_change(new, old, significant):
    assert new.significant_change(old) is significant


def test_summary_with_gpus():
    res = Resources(cpu_count=8, cpu_free=3.456, memory_total_mb=16384, memory_free_mb=8192,
                    gpus=(A100, dataclasses.replace(A100, index=1, uuid="GPU-2"), dataclasses.replace(H100, index=2)))
    assert res.summary() == ("2× NVIDIA A100-SXM4-80GB, 1× NVIDIA H100 80GB HBM3; "
                             "cpu 3.5/8 free; mem 8.0/16.0 GiB free")


def test_summary_without_gpus():
    res = Resources(cpu_count=4, cpu_free=0.0, memory_total_mb=2048, memory_free_mb=512)
    assert res.summary() == "cpu 0.0/4 free; mem 0.5/2.0 GiB free"


MiB = 1 << 20


class FakeNvml:
    """The part of pynvml the collector uses, with switches to make it fail."""

    class NVMLError(Exception):
        pass

    def __init__(self, init_fails=False, fail_on=None, no_utilization=False, no_capability=False,
                 shutdown_fails=False):
        self.init_fails = init_fails
        self.fail_on = fail_on
        self.no_utilization = no_utilization
        self.no_capability = no_capability
        self.shutdown_fails = shutdown_fails
        self.calls = []
        self.devices = [
            SimpleNamespace(name=b"NVIDIA A100-SXM4-80GB", uuid=b"GPU-aaaa", total=81920 * MiB, free=40960 * MiB,
                            util=37, cc=(8, 0)),
            SimpleNamespace(name="NVIDIA H100 80GB HBM3", uuid="GPU-bbbb", total=81559 * MiB,
                            free=81000 * MiB + 12345, util=0, cc=(9, 0)),
        ]

    def _call(self, name):
        self.calls.append(name)
        if self.fail_on == name:
            raise self.NVMLError(name)

    def nvmlInit(self):
        self._call("nvmlInit")
        if self.init_fails:
            raise self.NVMLError("Driver Not Loaded")

    def nvmlShutdown(self):
        self._call("nvmlShutdown")
        if self.shutdown_fails:
            raise self.NVMLError("Uninitialized")

    def nvmlDeviceGetCount(self):
        self._call("nvmlDeviceGetCount")
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index):
        self._call("nvmlDeviceGetHandleByIndex")
        return self.devices[index]

    def nvmlDeviceGetMemoryInfo(self, handle):
        self._call("nvmlDeviceGetMemoryInfo")
        return SimpleNamespace(total=handle.total, free=handle.free, used=handle.total - handle.free)

    def nvmlDeviceGetUtilizationRates(self, handle):
        self._call("nvmlDeviceGetUtilizationRates")
        if self.no_utilization:
            raise self.NVMLError("Not Supported")
        return SimpleNamespace(gpu=handle.util, memory=0)

    def nvmlDeviceGetCudaComputeCapability(self, handle):
        self._call("nvmlDeviceGetCudaComputeCapability")
        if self.no_capability:
            raise self.NVMLError("Not Supported")
        return handle.cc

    def nvmlDeviceGetName(self, handle):
        self._call("nvmlDeviceGetName")
        return handle.name

    def nvmlDeviceGetUUID(self, handle):
        self._call("nvmlDeviceGetUUID")
        return handle.uuid


def test_collector_reports_two_gpus():
    nvml = FakeNvml()
    c = Collector(nvml)
    assert c.gpu_backend == "nvml"
    gpus = c.sample().gpus
    assert gpus == (
        Gpu(index=0, name="NVIDIA A100-SXM4-80GB", uuid="GPU-aaaa", memory_total_mb=81920, memory_free_mb=40960,
            utilization_pct=37, compute_capability="8.0"),
        Gpu(index=1, name="NVIDIA H100 80GB HBM3", uuid="GPU-bbbb", memory_total_mb=81559, memory_free_mb=81000,
            utilization_pct=0, compute_capability="9.0"),
    )
    assert all(isinstance(g.name, str) and isinstance(g.uuid, str) for g in gpus)  # bytes (old pynvml) decoded


def test_collector_sample_passes_a_peers_checks():
    res = Collector(FakeNvml()).sample()
    assert Resources.from_wire(msgpack.unpackb(msgpack.packb(res.to_wire()))) == res


def test_no_driver_is_a_cpu_only_provider():
    nvml = FakeNvml(init_fails=True)
    c = Collector(nvml)
    assert c.gpu_backend == "none"
    assert c.sample().gpus == ()
    assert nvml.calls == ["nvmlInit"]
    c.close()
    assert "nvmlShutdown" not in nvml.calls


@pytest.mark.parametrize("call", ["nvmlDeviceGetCount", "nvmlDeviceGetHandleByIndex", "nvmlDeviceGetMemoryInfo",
                                  "nvmlDeviceGetName", "nvmlDeviceGetUUID"])
def test_driver_error_mid_sample_advertises_no_gpu(call):
    nvml = FakeNvml(fail_on=call)
    c = Collector(nvml)
    res = c.sample()
    assert res.gpus == ()
    assert res.cpu_count >= 1
    assert call in nvml.calls
    nvml.fail_on = None  # the hiccup passes: the next sample sees the GPUs again
    assert len(c.sample().gpus) == 2


def test_utilization_not_supported_reads_as_zero():
    gpus = Collector(FakeNvml(no_utilization=True)).sample().gpus
    assert [g.utilization_pct for g in gpus] == [0, 0]
    assert [g.memory_free_mb for g in gpus] == [40960, 81000]


def test_compute_capability_not_supported_is_empty():
    gpus = Collector(FakeNvml(no_capability=True)).sample().gpus
    assert [g.compute_capability for g in gpus] == ["", ""]


def test_close_shuts_nvml_down_once():
    nvml = FakeNvml()
    c = Collector(nvml)
    c.close()
    assert nvml.calls.count("nvmlShutdown") == 1
    assert c.gpu_backend == "none"
    assert c.sample().gpus == ()
    c.close()
    assert nvml.calls.count("nvmlShutdown") == 1


def test_close_ignores_a_shutdown_error():
    c = Collector(FakeNvml(shutdown_fails=True))
    c.close()
    assert c.gpu_backend == "none"


def test_real_collector_on_this_machine():
    c = Collector()
    backend = c.gpu_backend
    try:
        res = c.sample()
    finally:
        c.close()
    assert res.cpu_count >= 1
    assert 0.0 <= res.cpu_free <= res.cpu_count
    assert res.memory_total_mb > 0
    assert 0 <= res.memory_free_mb <= res.memory_total_mb
    if backend == "none":  # no pynvml, no driver or no device here
        assert res.gpus == ()
    assert Resources.from_wire(res.to_wire()) == res


@pytest.mark.parametrize("name", ["A100\x1b]52;c;aGk=\x07", "A100\rH100", "\u202eA100"])
def test_a_gpu_name_with_control_characters_is_refused(name):
    """People read GPU names (swarmctl peers): a member's record may not carry escapes in them."""
    data = wire_copy()
    data["gpus"][0]["name"] = name
    with pytest.raises(ValueError, match=r"gpus\[0\]\.name: expected printable text"):
        Resources.from_wire(data)
