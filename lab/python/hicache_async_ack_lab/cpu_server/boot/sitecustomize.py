# Put on PYTHONPATH by `hicache-async-ack-lab cpu-server` only: installs the CPU
# stand-ins at interpreter start, before SGLang imports sgl_kernel, in every
# process the server spawns (they inherit PYTHONPATH).
from hicache_async_ack_lab.cpu_server.standins import install

install()
