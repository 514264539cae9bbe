"""Runs a program under `specjax.rl.code_reward`'s limits, by path:

  python -I _sandbox_prelude.py CPU_S MEMORY_BYTES OUTPUT_BYTES PROGRAM

It sets its own resource limits (CPU seconds, address space, file size, open files, core
dumps), then installs an audit hook that refuses the events of sockets, process creation
and signals to other processes, and runs PROGRAM as `__main__`. An audit hook cannot be
removed from Python; code that reaches the C library directly (ctypes) can get around it,
which is why the limits are set by the kernel and the network is also cut by a namespace
where the system allows one. It imports nothing of specjax.
"""

import resource
import runpy
import sys

REFUSED = ("socket.", "os.fork", "os.forkpty", "os.system", "os.exec", "os.spawn",
           "os.posix_spawn", "os.kill", "os.killpg", "subprocess.Popen", "pty.spawn",
           "ctypes.dlopen")


def _refuse(event: str, args) -> None:
  if event.startswith(REFUSED):
    raise PermissionError(f"refused in the code reward's sandbox: {event} (no network, no new "
                          "processes)")


def main() -> None:
  cpu_s, memory, output, program = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]),
                                    sys.argv[4])
  for limit, value in ((resource.RLIMIT_CPU, cpu_s), (resource.RLIMIT_AS, memory),
                       (resource.RLIMIT_FSIZE, output), (resource.RLIMIT_NOFILE, 64),
                       (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(limit, (value, value))
  sys.argv = [program]
  sys.addaudithook(_refuse)
  runpy.run_path(program, run_name="__main__")


if __name__ == "__main__":
  main()
