"""Produce logs of real failures for the crash-detector tests.

Each scenario is a small program that really fails the way a trainer can: a Python
thread dies, the interpreter segfaults, the process gets SIGKILL, torch raises on CPU,
torch.compile fails. It runs with stdout and stderr going to one pipe, as the launcher
sends both to train.log, so the interleaving between threads is real.

    python tests/data/make_real_logs.py            # (re)write tests/data/logs/real-*.log
    python tests/data/make_real_logs.py thread-exception
    python tests/data/make_real_logs.py --trainer [NAME ...]   # the bundled trainer's own
        # failures, plain, under torchrun (2 ranks) and as 2 nodes: tests/data/trainer_logs.py

Each log gets a sidecar real-<name>.expected.json with what the detector must find.
The tests also run the scenarios without torch live (see tests/test_crash_real.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

LOG_DIR = Path(__file__).resolve().parent / "logs"


@dataclass(frozen=True)
class Scenario:
    name: str
    program: str
    expected: list[dict]  # what the detector must report, root cause first
    via_shell: bool = False  # run under `bash -c` like launch.sh, so bash reports a kill
    needs_torch: bool = False
    run_in_tests: bool = True  # False: too slow to run on every test run; the log is committed
    python_flags: tuple[str, ...] = ()


THREAD_EXCEPTION = Scenario(
    name="thread-exception",
    program="""
        import sys, threading, time

        def say(line):  # one write per line, as the trainer logs: no torn lines
            sys.stdout.write(line + "\\n")
            sys.stdout.flush()

        def prefetch():
            say("drafter-1 on cpu: loading shard 3")
            time.sleep(0.05)
            batch = {"input_ids": [1, 2, 3]}
            return batch["hidden_states"]

        worker = threading.Thread(target=prefetch, name="drafter-1")
        worker.start()
        for step in range(1, 9):
            say(f"step {step}/8 | loss {2.4 - step * 0.05:.2f} | acc 0.5 | queue 3/8")
            time.sleep(0.02)
        worker.join()
        say("training complete")
    """,
    expected=[
        {
            "category": "thread_exception",
            "thread": "drafter-1",
            "device": "cpu",
            "stage": "loading shard 3",
            "exception": "KeyError",
        }
    ],
)

CONCURRENT_THREAD_FAILURES = Scenario(
    name="concurrent-thread-failures",
    program="""
        import sys, threading, traceback

        start = threading.Barrier(4)
        output = threading.Lock()

        def say(text):
            # The trainer's way: one write per message under a lock. CPython's own
            # threading.excepthook writes a header in pieces, and threads failing at
            # once garble it (see real-garbled-excepthook.txt).
            with output:
                sys.stdout.write(text)
                sys.stdout.flush()

        def warm_up(index):
            name = f"drafter-{index}"
            say(f"{name} on cuda:{index}: warming compiled graphs\\n")
            start.wait()
            try:
                compiled = {}
                compiled[("graph", index)]  # every worker fails at the same moment
            except KeyError:
                say(f"{name} failed:\\n" + traceback.format_exc())
                for step in range(3):
                    say(f"{name} on cuda:{index}: shutting down ({step})\\n")

        workers = [
            threading.Thread(target=warm_up, args=(i,), name=f"drafter-{i}") for i in range(4)
        ]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        sys.exit(1)
    """,
    # Which thread prints first varies from run to run: the test checks the set.
    expected=[
        {
            "category": "thread_exception",
            "exception": "KeyError",
            "stage": "warming compiled graphs",
        }
    ]
    * 4,
)

SEGFAULT = Scenario(
    name="segfault",
    program="""
        import ctypes
        print("drafter-0 on cpu: warming compiled graphs", flush=True)
        ctypes.string_at(0)
    """,
    python_flags=("-X", "faulthandler"),
    expected=[{"category": "segfault", "rule": "segfault"}],
)

SIGKILL = Scenario(
    name="sigkill",
    program="""
        import os, signal
        for step in range(1, 6):
            print(f"step {step}/10 | loss {2.0 - step * 0.1:.2f} | acc 0.5", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """,
    expected=[{"category": "killed"}],
)

SIGKILL_UNDER_BASH = Scenario(
    name="sigkill-bash",
    program=SIGKILL.program,
    via_shell=True,
    expected=[{"category": "killed", "rule": "killed"}],
)

TORCH_SHAPE_ERROR = Scenario(
    name="torch-thread-error",
    needs_torch=True,
    program="""
        import sys, threading, traceback, time
        import torch

        failures = []
        # Like the trainer's own log: one write per message under a lock, so lines of
        # different threads never merge (print() writes text and newline separately).
        out = threading.Lock()

        def say(text):
            with out:
                sys.stdout.write(text + chr(10))
                sys.stdout.flush()

        def drafter(index):
            name = f"drafter-{index}"
            try:
                say(f"{name} on cpu: warming compiled graphs")
                layer = torch.nn.Linear(16, 4)
                width = 8 if index == 1 else 16
                for _ in range(3):
                    layer(torch.randn(4, width)).sum().backward()
                    time.sleep(0.01)
                say(f"{name} on cpu: ready")
            except Exception as exc:
                say(f"{name} failed:" + chr(10) + traceback.format_exc().rstrip())
                failures.append((name, exc))

        threads = [threading.Thread(target=drafter, args=(i,), name=f"drafter-{i}") for i in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if failures:
            name, exc = failures[0]
            raise RuntimeError(f"{name} failed: {type(exc).__name__}") from exc
    """,
    expected=[
        {
            "category": "thread_exception",
            "thread": "drafter-1",
            "device": "cpu",
            "stage": "warming compiled graphs",
            "exception": "RuntimeError",
        },
        {"category": "python_exception", "exception": "RuntimeError"},
    ],
)

DYNAMO_BACKEND_FAILURE = Scenario(
    name="dynamo-backend-failure",
    needs_torch=True,
    program="""
        import torch

        def broken_backend(graph_module, example_inputs):
            raise RuntimeError("lowering failed for aten.index_put (demo backend)")

        def drafter_step(x, w):
            return torch.relu(x @ w).sum()

        print("drafter-0 on cpu: compiling drafter (backend=broken_backend)", flush=True)
        step = torch.compile(drafter_step, backend=broken_backend)
        step(torch.randn(4, 8), torch.randn(8, 8))
    """,
    expected=[
        {"category": "compile_error", "exception": "torch._dynamo.exc.BackendCompilerFailed"}
    ],
)

INDUCTOR_COMPILE_ERROR = Scenario(
    name="inductor-compile-error",
    needs_torch=True,
    run_in_tests=False,  # a real g++ run: about 10 s
    program="""
        import sys, threading, traceback
        import torch
        import torch._inductor.config as inductor_config

        def worker():
            # Inductor's own test switch: generate C++ that does not compile.
            inductor_config.cpp.inject_relu_bug_TESTING_ONLY = "compile_error"
            try:
                print("drafter-0 on cpu: compiling drafter (inductor)", flush=True)
                step = torch.compile(lambda x: torch.relu(x) * 2)
                step(torch.randn(8))
            except Exception:
                print("drafter-0 failed:", flush=True)
                traceback.print_exc()
                sys.stdout.flush()
                sys.stderr.flush()
                raise SystemExit(1)

        thread = threading.Thread(target=worker, name="drafter-0")
        thread.start()
        thread.join()
        sys.exit(1)
    """,
    expected=[
        {
            "category": "compile_error",
            "thread": "drafter-0",
            "device": "cpu",
            "exception": "torch._inductor.exc.InductorError",
        }
    ],
)

SCENARIOS = [
    THREAD_EXCEPTION,
    CONCURRENT_THREAD_FAILURES,
    SEGFAULT,
    SIGKILL,
    SIGKILL_UNDER_BASH,
    TORCH_SHAPE_ERROR,
    DYNAMO_BACKEND_FAILURE,
    INDUCTOR_COMPILE_ERROR,
]


def run_scenario(scenario: Scenario, *, timeout: float = 120) -> tuple[str, int]:
    """Run the program; return its combined output and exit status (128+N under bash)."""
    argv = [sys.executable, *scenario.python_flags, "-c", textwrap.dedent(scenario.program)]
    if scenario.via_shell:
        # A non-interactive bash reports a child killed by a signal, as launch.sh would.
        argv = ["bash", "-c", 'cd /tmp && "$@"; exit $?', "launch.sh", *argv]
    proc = subprocess.run(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout, check=False
    )
    return proc.stdout.decode("utf-8", "replace"), proc.returncode


def write_log(scenario: Scenario) -> Path:
    text, exit_code = run_scenario(scenario)
    log = LOG_DIR / f"real-{scenario.name}.log"
    log.write_text(text, encoding="utf-8")
    sidecar = log.with_suffix(".expected.json")
    sidecar.write_text(
        json.dumps({"exit_code": exit_code, "crashes": scenario.expected}, indent=1) + "\n",
        encoding="utf-8",
    )
    return log


def main(names: list[str]) -> None:
    if names[:1] == ["--trainer"]:  # the bundled trainer itself: tests/data/trainer_logs.py
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import trainer_logs

        trainer_logs.main(names[1:])
        return
    chosen = [s for s in SCENARIOS if not names or s.name in names]
    for scenario in chosen:
        print(f"{scenario.name}: {write_log(scenario)}")


if __name__ == "__main__":
    main(sys.argv[1:])
