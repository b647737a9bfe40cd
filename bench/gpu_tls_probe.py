"""Minimal check of the CUDA Graph Trees thread-state bug and its fix on a GPU.

    python bench/gpu_tls_probe.py            # runs both cases in child processes
    python bench/gpu_tls_probe.py --case off # one case in this process

Case ``off``: a ``threading.Thread`` runs a ``torch.compile(mode="reduce-overhead")``
model forward + backward without the thread-state fix; on torch <= 2.12 it fails with
the ``AssertionError`` from cudagraph_trees. Case ``on``: the same with the fix; the
thread's tree manager must hold recorded graphs and the gradients must match eager.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer"))

import torch  # noqa: E402
from dflash.pipeline import tls  # noqa: E402


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256)
    ).cuda()


def _worker(case: str, result: dict) -> None:
    try:
        if case == "on":
            result["install"] = tls.install_thread_state().reason
        model = _model()
        compiled = torch.compile(model, mode="reduce-overhead")
        x = torch.randn(64, 256, device="cuda", generator=None)
        for _ in range(4):
            model.zero_grad(set_to_none=True)
            loss = compiled(x).square().mean()
            loss.backward()
        grads = [p.grad.detach().clone() for p in model.parameters()]
        reference = _model()
        reference.load_state_dict(model.state_dict())
        reference(x).square().mean().backward()
        diff = max(
            (g - p.grad).abs().max().item()
            for g, p in zip(grads, reference.parameters(), strict=False)
        )
        result["max_grad_diff"] = diff
        result["recorded_graphs"] = tls.recorded_graph_count()
        from torch._dynamo.utils import counters

        result["cudagraph_skips"] = counters["inductor"]["cudagraph_skips"]
    except BaseException as exc:  # the point is to see exactly what fails
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()


def run_case(case: str) -> int:
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}, case {case}", flush=True)
    print(f"torch initialises thread state itself: {tls.torch_fixes_thread_state()}", flush=True)
    result: dict = {}
    thread = threading.Thread(target=_worker, args=(case, result), name="drafter-0")
    thread.start()
    thread.join()
    if "error" in result:
        print("drafter-0 failed:")
        print(result["traceback"], end="", flush=True)
        return 1
    print(f"result: {result}", flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=["off", "on"])
    args = parser.parse_args()
    if args.case:
        return run_case(args.case)
    codes = {}
    for case in ("off", "on"):
        codes[case] = subprocess.call([sys.executable, __file__, "--case", case])
    print(f"exit codes: {codes}")
    return 0 if codes["on"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
