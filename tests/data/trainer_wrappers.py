"""More real logs of the bundled trainer (written by `make_real_logs.py --trainer`, as
trainer_logs.py's): hangs named after the fact, the rank that failed rather than the
one that noticed, and environments whose advice differs (a code error in the trainer's
own module, a wrong master address, bad UTF-8 in the data, Ctrl-C during start-up).

What a user adds to the trainer (a thread of their own, a lock-order bug) is added the
way a user would: a wrapper script that sets it up, then runs train_dflash_pipeline.py
(trainer_logs.wrapper_program); nothing in the trainer announces it.
"""

from __future__ import annotations

from trainer_logs import LONG, TrainerScenario

# The trainer's own watchdog fires after 5 s without a finished step (run.hang.min_s: 5);
# before the first step after 90 s (its floor there).
QUICK_WATCHDOG = {"DFLASH_HANG_MIN_S": "5"}
# The same, with no start-up watchdog within the scenario's time (a loaded machine
# takes a minute to start).
STEPS_WATCHDOG = {**QUICK_WATCHDOG, "DFLASH_HANG_STARTUP_S": "3600"}


def _hook(body: str, *, thread: str, stage: str, step: int = 0, ranks: tuple = (0, 1)) -> str:
    """Run `body` (indented code) in `thread` at `stage` (and `step`) on `ranks`."""
    return f"""
import threading, time
import dflash.pipeline.threads as _threads
_inject = _threads.inject

def _inject_and_more(ctx, thread, stage, step=0):
    if (thread, stage, step) == ({thread!r}, {stage!r}, {step}) and ctx.world.rank in {ranks!r}:
{body}
    _inject(ctx, thread, stage, step)

_threads.inject = _inject_and_more
"""


# Two locks taken in opposite orders by drafter-0 and a thread the user added.
_LOCK_ORDER_THREAD = """
import threading, time
_first, _second = threading.Lock(), threading.Lock()
_go = threading.Event()

def push_metrics():
    _go.wait()
    with _second:
        time.sleep(0.5)
        with _first:
            pass

threading.Thread(target=push_metrics, name="metrics-push", daemon=True).start()
"""
_LOCK_ORDER_BODY = """        with _first:
            _go.set()
            time.sleep(0.5)
            with _second:
                pass"""


def lock_order_deadlock(stage: str, step: int = 0, ranks: tuple = (0, 1)) -> str:
    return _LOCK_ORDER_THREAD + _hook(
        _LOCK_ORDER_BODY, thread="drafter-0", stage=stage, step=step, ranks=ranks
    )


# A user's thread failing at the very moment drafter-0 does (debug.fail_in).
_TWO_FAILING = """
import threading as _threading
_failing = _threading.Event()

def upload_samples():
    _failing.wait()
    raise ConnectionResetError(104, "upload of samples: connection reset by peer")

_threading.Thread(target=upload_samples, name="sample-upload", daemon=True).start()
""" + _hook("        _failing.set()", thread="drafter-0", stage="step", step=10)

# Rank 1 stalls before its all-reduce (a slow filesystem read, say): it never issues
# the step's collective, and rank 0's gloo all-reduce times out.
_STALL_RANK1 = _hook(
    "        time.sleep(3600)", thread="drafter-0", stage="step", step=11, ranks=(1,)
)

_BAD_UTF8_JSONL = (
    b"".join(
        b'{"text": "record number %d of the training data, plain text"}\n' % i
        for i in range(1, 400)
    )
    + b'{"text": "a byte that is not UTF-8: \xff\xfe here"}\n'
    + b'{"text": "never read"}\n'
)


MORE_SCENARIOS = [
    # --- hangs, named after the fact -------------------------------------------------
    TrainerScenario(
        "trainer-lock-deadlock-stop",
        [
            {
                "root_cause": {"category": "hang", "thread": "drafter-0"},
                "status": "hung",
            }
        ],
        sets=LONG,
        wrapper=lock_order_deadlock("step", 10),
        env=STEPS_WATCHDOG,
        action="stop-on-watchdog",
    ),
    TrainerScenario(
        "trainer-startup-deadlock",
        [
            {
                "root_cause": {"category": "hang", "thread": "drafter-0"},
                "status": "hung",
                "detail": "before the first step",
            }
        ],
        sets=LONG,
        wrapper=lock_order_deadlock("warmup"),
        env=QUICK_WATCHDOG,
        action="stop-on-watchdog",
    ),
    TrainerScenario(
        "torchrun-deadlock-rank1",
        [
            {
                "exit_code": 1,
                "root_cause": {"category": "hang", "rank": 1, "thread": "drafter-0"},
                "status": "hung",
            }
        ],
        sets=(*LONG, "runtime.dist_timeout_s=20"),
        wrapper=lock_order_deadlock("step", 10, ranks=(1,)),
        env=STEPS_WATCHDOG,
        ranks=2,
    ),
    TrainerScenario(
        "torchrun-no-collective-rank1",
        [{"exit_code": 1, "root_cause": {"category": "gloo_timeout", "rank": 1}}],
        sets=(*LONG, "runtime.dist_timeout_s=10"),
        wrapper=_STALL_RANK1,
        ranks=2,
    ),
    # --- two threads failing at once: the trainer's own line names its thread --------
    TrainerScenario(
        "trainer-two-threads-failing",
        [{"exit_code": 1, "root_cause": {"category": "thread_exception", "thread": "drafter-0"}}],
        sets=("debug.fail_in=drafter-0@step:10",),
        wrapper=_TWO_FAILING,
    ),
    # --- the environment -------------------------------------------------------------
    TrainerScenario(
        "trainer-import-error-own-module",
        [
            {
                "exit_code": 1,
                "root_cause": {"category": "code_error"},
                "detail": "dflash/pipeline/threads.py:27",
            }
        ],
        patch=(
            "dflash/pipeline/threads.py",
            "from dflash.pipeline import stacks, tls",
            "from dflash.pipeline import stacks, tls_cache",
        ),
    ),
    TrainerScenario(
        "trainer-bad-utf8-data",
        [{"exit_code": 1, "root_cause": {"category": "data_error"}, "detail": "train.jsonl:400"}],
        sets=("data.source={scratch}/train.jsonl",),
        binary_files={"train.jsonl": _BAD_UTF8_JSONL},
    ),
    TrainerScenario(
        "trainer-ctrl-c-at-start",
        [{"root_cause": {"category": "interrupted"}, "status": "stopped"}],
        action="sigint-at-start",
    ),
    TrainerScenario(
        "nodes-wrong-master-addr",
        [
            {"root_cause": {"category": "rendezvous"}},
            {"root_cause": {"category": "rendezvous"}},
        ],
        unreachable_nodes=(1,),
        nodes=2,
        launcher_args=("--rdzv-conf=timeout=30",),
        timeout_s=120,
    ),
    TrainerScenario(
        "nodes-port-held",
        [
            {"exit_code": 1, "root_cause": {"category": "port_in_use"}},
            {"root_cause": {"category": "hang"}, "status": "hung"},
        ],
        nodes=2,
        ranks=2,  # per node: torchrun prints its banner, then nothing (no rank starts)
        action="hold-port",
        timeout_s=90,
    ),
    # --- clean: no false alarm with the quick watchdog on -----------------------------
    TrainerScenario(
        "torchrun-clean-quick-watchdog",
        [{"exit_code": 0, "root_cause": None}],
        env=QUICK_WATCHDOG,
        ranks=2,
    ),
    TrainerScenario(
        "trainer-clean-with-user-thread",
        [{"exit_code": 0, "root_cause": None}],
        wrapper=_LOCK_ORDER_THREAD,  # the thread waits for ever; nothing takes the locks
        env=QUICK_WATCHDOG,
    ),
]
