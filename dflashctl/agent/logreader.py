"""The `log` verb: a run's train.log, streamed from a byte offset in frames.

Frames on stdout, each a header line, `D` followed by that many bytes of log:
  S <start> <size>  the log is open; reading starts at byte <start>, it had <size> bytes
  D <n>             n bytes of log
  R                 the log was truncated or replaced: offsets start again at 0
  W                 no log yet (a run that is starting)
  H                 heartbeat, after a second of silence
  N                 no such run folder
  E                 the run is over (or `once`) and the log was read to its end
The end check comes before each read, so the read that finds the end of the file after
it comes has seen everything the run wrote. "Over" is the run state the `runs` verb
reports (an exit code, or a pid that is gone or now belongs to another process); a run
with no pid file yet is starting.
"""

import os
import sys
import time

from .runs import run_over, runs_dir

PROTOCOL_MAGIC = b"DFLASH-LOG 1\n"
HEARTBEAT_S = 1.0
PAUSE_S = 0.05


class _Frames:
    def __init__(self, out):
        self.out = out
        self.last = 0.0

    def emit(self, head, data=b""):
        self.out.write(head.encode() + b"\n" + data)
        self.out.flush()
        self.last = time.monotonic()


def stream_log(workdir, run_id, pos, backlog, once):
    out = sys.stdout.buffer
    try:
        _stream(out, workdir, run_id, pos, backlog, once)
    except BrokenPipeError:
        # The follower went away: nothing left to say to anyone.
        os._exit(0)


def _stream(out, workdir, run_id, pos, backlog, once):
    rundir = os.path.join(runs_dir(workdir), run_id)
    log = os.path.join(rundir, "train.log")
    frames = _Frames(out)
    out.write(PROTOCOL_MAGIC)
    # A run id is one name under runs/: `../x` would read a train.log anywhere.
    if run_id in ("", ".", "..") or "/" in run_id or not os.path.isdir(rundir):
        frames.emit("N")
        return
    f, inode, waiting = None, None, False
    while True:
        over = run_over(workdir, run_id)
        if f is None:
            try:
                f = open(log, "rb")
            except FileNotFoundError:
                if over or once:
                    frames.emit("E")
                    return
                if not waiting:
                    frames.emit("W")
                    waiting = True
            else:
                st = os.fstat(f.fileno())
                inode = st.st_ino
                if pos > st.st_size:
                    frames.emit("R")
                    pos = 0
                if 0 <= backlog < st.st_size - pos:
                    f.seek(st.st_size - backlog)
                    f.readline()
                    pos = f.tell()
                f.seek(pos)
                frames.emit(f"S {pos} {st.st_size}")
                continue
        else:
            data = f.read(1 << 16)
            if data:
                frames.emit(f"D {len(data)}", data)
                pos += len(data)
                continue
            if over or once:
                frames.emit("E")
                return
            try:
                st = os.stat(log)
            except FileNotFoundError:
                st = None
            if st is None or st.st_ino != inode:
                f.close()
                f, pos = None, 0
                frames.emit("R")
                continue
            if st.st_size < pos:
                f.seek(0)
                pos = 0
                frames.emit("R")
                continue
        if time.monotonic() - frames.last >= HEARTBEAT_S:
            frames.emit("H")
        time.sleep(PAUSE_S)
