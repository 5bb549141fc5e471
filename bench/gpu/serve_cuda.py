"""A service replica (bench/gpu, check 5): scikit-learn's digits MLP (64 -> 4096 x 3 -> 10) on
CUDA behind a plain HTTP server on $PORT, reached through the gateway. `GET /?i=N` classifies
test image N: {"digit": d, "label": l, "device": "cuda:0"}."""

from __future__ import annotations

import http.server
import json
import os
import urllib.parse

import torch
from sklearn.datasets import load_digits

device = "cuda" if torch.cuda.is_available() else "cpu"
digits = load_digits()
x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
y = torch.tensor(digits.target)
model = torch.nn.Sequential(torch.nn.Linear(64, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 4096), torch.nn.ReLU(),
                            torch.nn.Linear(4096, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 10)).to(device)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
for _ in range(60):  # a few full-batch steps: good enough to answer, quick on a GPU
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x.to(device)), y.to(device)).backward()
    opt.step()
model.eval()


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
        i = int(query.get("i", ["0"])[0]) % len(x)
        with torch.no_grad():
            digit = int(model(x[i:i + 1].to(device)).argmax())
        body = json.dumps({"digit": digit, "label": int(y[i]), "device": str(next(model.parameters()).device)})
        data = body.encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


print("serving on", os.environ["PORT"], "with", device, flush=True)
http.server.ThreadingHTTPServer(("0.0.0.0", int(os.environ["PORT"])), Handler).serve_forever()
