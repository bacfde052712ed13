"""The keeper of one rank: ``pmetal launch`` runs this file's text as
``python -c <text> <spec>`` (locally, or on another host through ssh), so it
imports only the standard library: on a remote host nothing is on the path yet.

``spec`` is JSON: ``cwd`` (enter it), ``env`` (add it to the environment),
``argv`` (the rank's program) and ``grace`` (seconds between SIGTERM and
SIGKILL). The keeper makes its own process group, starts ``argv`` in it and
waits. It exits as its rank did: with its code, or killed by its signal.

Why a keeper at all: the launcher must be able to stop a rank wherever it
runs, and ssh carries no signals (without a terminal) but does carry stdin.
So the keeper reads its stdin, one word a line: ``INT`` or ``TERM`` sends
that signal to the rank, ``KILL`` kills the whole group (the rank, whatever
it started, and the keeper). End of file means the launcher is gone (killed,
or its ssh connection dropped): the rank gets SIGTERM, and the group SIGKILL
after the grace period, so no rank outlives its launcher. SIGINT, SIGTERM
and SIGHUP sent to the keeper itself are passed on to the rank.
"""

import json
import os
import signal
import subprocess
import sys
import threading


def _control(child, done, grace):
    for line in sys.stdin:
        word = line.strip()
        if word in ("INT", "TERM"):
            child.send_signal(getattr(signal, "SIG" + word))
        elif word == "KILL":
            os.killpg(0, signal.SIGKILL)
    if not done.is_set():  # the launcher let go of us: stop the rank
        child.send_signal(signal.SIGTERM)
        if not done.wait(grace):
            os.killpg(0, signal.SIGKILL)


def main():
    spec = json.loads(sys.argv[1])
    try:
        os.chdir(spec["cwd"])
    except OSError as exc:
        print(f"pmetal launch: cannot enter the directory {spec['cwd']!r} on this host: "
              f"{exc.strerror}", file=sys.stderr)
        return 127
    env = dict(os.environ)
    env.update(spec["env"])
    try:
        os.setpgid(0, 0)
    except OSError:  # already a group leader: the launcher gave us a session of our own
        pass
    try:
        child = subprocess.Popen(spec["argv"], env=env, stdin=subprocess.DEVNULL)
    except OSError as exc:
        print(f"pmetal launch: cannot start {spec['argv'][0]!r} on this host: {exc.strerror}",
              file=sys.stderr)
        return 127
    done = threading.Event()
    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    for signum in signals:
        signal.signal(signum, lambda signum, frame: child.send_signal(signum))
    # The control thread blocks these signals: one the kernel gave it would wait
    # for the main thread to wake from child.wait(), which is when the rank ends.
    saved = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    threading.Thread(target=_control, args=(child, done, spec["grace"]), daemon=True).start()
    signal.pthread_sigmask(signal.SIG_SETMASK, saved)
    code = child.wait()
    done.set()
    if code < 0:  # die of the same signal, so that the launcher can name it
        import resource
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # the rank dumped core, not us
        if -code != signal.SIGKILL:  # the one signal whose handler cannot be set
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        return 128 - code
    return code


if __name__ == "__main__":
    sys.exit(main())
