"""Simulated hosts on one machine, for the tests and benchmarks of groups that
span hosts.

Each host is a network namespace joined to the others by a veth on a shared
bridge (the bridge lives in a namespace of its own, so the machine's own
network is never touched), with a private-range address, and its processes
run in a mount and UTS namespace of their own: a private tmpfs /dev/shm, its
own hostname, and an /etc/hosts that names every host. To hsdp they are
different hosts (different hostnames and namespaces), as to torchrun and
Gloo, which reach each other over the veths.

    with SimHosts(2) as hosts:
        procs = [hosts.torchrun(h, 2, ["train.py", "--steps", "10"]) for h in range(2)]
        ...
        hosts.link(1, up=False)     # the host's link goes down

Needs root and iproute2. Everything is removed on exit, also after a failure
or a timeout: the processes (each host's in a session of its own) are killed,
the namespaces deleted; namespaces a killed run left behind are swept the
next time. From the command line:

    python tools/simhosts.py --hosts 2 --nproc-per-host 2 -- script.py [args]

runs torchrun on every host (c10d rendezvous on host 0) and exits with the
first non-zero exit status.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

PREFIX = "hsdpsim"  # namespaces and interfaces: hsdpsim<pid>-...
RDZV_PORT = 29400


class Unavailable(RuntimeError):
    """Namespaces cannot be made here (not root, no iproute2, a container
    that forbids them)."""


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def _netns() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _kill_everything_in(ns: str) -> None:
    pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
    for pid in pids.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def sweep_stale() -> None:
    """Kills the processes and deletes the namespaces of runs whose owner
    is gone (killed before it could clean up)."""
    for ns in _netns():
        if not ns.startswith(PREFIX):
            continue
        owner = ns[len(PREFIX) :].split("-")[0]
        if owner.isdigit() and not os.path.exists(f"/proc/{owner}"):
            _kill_everything_in(ns)
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True)


def why_unavailable() -> str | None:
    """None when simulated hosts can be made here, else the reason."""
    if os.geteuid() != 0:
        return "simulated hosts need root (network and mount namespaces)"
    for tool in ("ip", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"simulated hosts need {tool!r} (iproute2 / util-linux)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
    shared = subprocess.run(
        [
            "unshare",
            "--mount",
            "--uts",
            "--propagation",
            "private",
            "sh",
            "-c",
            "mount -t tmpfs tmpfs /dev/shm && hostname probe",
        ],
        capture_output=True,
        text=True,
    )
    if shared.returncode != 0:
        return f"cannot create a mount namespace with its own /dev/shm: {shared.stderr.strip()}"
    return None


class SimHosts:
    """`count` simulated hosts named host0, host1, ... (see the module)."""

    def __init__(self, count: int):
        why = why_unavailable()
        if why:
            raise Unavailable(why)
        sweep_stale()
        self.count = count
        self.tag = f"{PREFIX}{os.getpid()}-{random.randrange(1 << 20):x}"
        self.subnet = f"10.{random.randrange(200, 250)}.{random.randrange(256)}"
        self.dir = tempfile.mkdtemp(prefix="hsdp-simhosts-")
        self.procs: list[subprocess.Popen] = []
        self._made: list[str] = []

    # -- names

    def name(self, h: int) -> str:
        return f"host{h}"

    def address(self, h: int) -> str:
        return f"{self.subnet}.{h + 1}"

    def netns(self, h: int) -> str:
        return f"{self.tag}-h{h}"

    def _switch(self) -> str:
        return f"{self.tag}-sw"

    def _veth(self, h: int) -> tuple[str, str]:
        # Interface names are at most 15 characters.
        return f"hv{h}", f"sv{h}"

    # -- lifetime

    def __enter__(self) -> SimHosts:
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _create(self) -> None:
        sw = self._switch()
        _run("ip", "netns", "add", sw)
        self._made.append(sw)
        _run("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", sw, "link", "set", "br0", "up")
        with open(os.path.join(self.dir, "hosts"), "w") as f:
            f.write("127.0.0.1 localhost\n")
            for h in range(self.count):
                f.write(f"{self.address(h)} {self.name(h)}\n")
        for h in range(self.count):
            ns = self.netns(h)
            _run("ip", "netns", "add", ns)
            self._made.append(ns)
            inner, outer = self._veth(h)
            _run(
                "ip",
                "-n",
                sw,
                "link",
                "add",
                outer,
                "type",
                "veth",
                "peer",
                "name",
                inner,
                "netns",
                ns,
            )
            _run("ip", "-n", sw, "link", "set", outer, "master", "br0", "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.address(h)}/24", "dev", inner)
            _run("ip", "-n", ns, "link", "set", inner, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")

    def close(self) -> None:
        """Kills every process started here, deletes the namespaces."""
        # Every process in a host's namespace: torchrun starts its workers
        # in sessions of their own, out of reach of the group kill below.
        for ns in self._made:
            _kill_everything_in(ns)
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True)
        self._made.clear()
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- running

    def popen(
        self, h: int, argv: list[str], env: dict[str, str] | None = None, **kwargs
    ) -> subprocess.Popen:
        """Runs `argv` on host h (its own session, so close() kills it all).
        After it exits, the host's /dev/shm listing is in shm_left(h)."""
        listing = os.path.join(self.dir, f"shm-left-{h}-{len(self.procs)}")
        script = (
            'mount -t tmpfs -o size=50% tmpfs /dev/shm && mount --bind "$HOSTS" /etc/hosts '
            '&& hostname "$HOSTNAME_" || exit 97; '
            '"$@"; rc=$?; ls -A /dev/shm > "$LISTING"; exit $rc'
        )
        full_env = dict(os.environ if env is None else env)
        full_env.update(
            HOSTS=os.path.join(self.dir, "hosts"), HOSTNAME_=self.name(h), LISTING=listing
        )
        cmd = [
            "ip",
            "netns",
            "exec",
            self.netns(h),
            "unshare",
            "--mount",
            "--uts",
            "--propagation",
            "private",
            "sh",
            "-c",
            script,
            "sh",
            *argv,
        ]
        p = subprocess.Popen(cmd, env=full_env, start_new_session=True, **kwargs)
        p.shm_listing = listing  # type: ignore[attr-defined]
        self.procs.append(p)
        return p

    def torchrun(
        self,
        h: int,
        nproc: int,
        script_and_args: list[str],
        env: dict[str, str] | None = None,
        python: str = sys.executable,
        rdzv_id: str | None = None,
        torchrun_args: tuple[str, ...] = (),
        **kwargs,
    ) -> subprocess.Popen:
        """torchrun on host h: `nproc` ranks, c10d rendezvous on host 0."""
        argv = [
            python,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            str(self.count),
            "--nproc-per-node",
            str(nproc),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"{self.name(0)}:{RDZV_PORT}",
            "--rdzv-id",
            rdzv_id or self.tag,
            "--max-restarts",
            "0",
            *torchrun_args,
            *script_and_args,
        ]
        return self.popen(h, argv, env=env, **kwargs)

    @staticmethod
    def shm_now(p: subprocess.Popen) -> list[str] | None:
        """What the host of `p` (still running) has in /dev/shm now."""
        if p.poll() is not None:
            return None
        listing = subprocess.run(
            ["nsenter", "--target", str(p.pid), "--mount", "ls", "-A", "/dev/shm"],
            capture_output=True,
            text=True,
        )
        return listing.stdout.split() if listing.returncode == 0 else None

    @staticmethod
    def shm_left(p: subprocess.Popen) -> list[str]:
        """What `p`'s host had in /dev/shm when `p` exited (None: unknown)."""
        try:
            with open(p.shm_listing) as f:  # type: ignore[attr-defined]
                return f.read().split()
        except OSError:
            return None  # type: ignore[return-value]

    def link(self, h: int, up: bool) -> None:
        """Takes host h's link down (or back up): its packets stop, its
        sockets stay open, as when a cable or a switch port fails."""
        _run("ip", "-n", self._switch(), "link", "set", self._veth(h)[1], "up" if up else "down")


def wait_all(procs: list[subprocess.Popen], timeout_s: float) -> list[int | None]:
    """Exit statuses (None: still running at the deadline)."""
    deadline = time.monotonic() + timeout_s
    out: list[int | None] = []
    for p in procs:
        try:
            out.append(p.wait(timeout=max(0.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            out.append(None)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--nproc-per-host", type=int, default=2)
    parser.add_argument(
        "--timeout", type=float, default=3600, help="seconds before everything is killed"
    )
    parser.add_argument("script", nargs=argparse.REMAINDER, help="-- script.py [args]")
    args = parser.parse_args()
    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    if not script:
        parser.error("give the script to run after --")
    with SimHosts(args.hosts) as hosts:
        procs = [hosts.torchrun(h, args.nproc_per_host, script) for h in range(args.hosts)]
        codes = wait_all(procs, args.timeout)
    for h, code in enumerate(codes):
        if code != 0:
            print(
                f"simhosts: host{h} {'timed out' if code is None else f'exited with {code}'}",
                file=sys.stderr,
            )
            return 1 if code is None else code
    return 0


if __name__ == "__main__":
    sys.exit(main())
