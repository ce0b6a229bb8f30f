"""hicache-async-ack-lab: what measures, demonstrates and tests the plugin
(``hicache_async_ack``), shipped as a distribution of its own so that GPU nodes
install only the plugin. Imports the plugin; the plugin never imports this.

- :mod:`.bench`: the step bench and ``bench-server`` (SGLang's real server);
- :mod:`.cpu_server`: SGLang's ``launch_server`` on a CPU host, with stand-ins;
- :mod:`.intree`, :mod:`.upstream_patch`: the in-tree form, as a patch;
- :mod:`.releases`: the guard's fingerprint table, release overlays;
- :mod:`.sim`, :mod:`.testing`: the simulated cache and the tests' scenarios.
"""

# Released together with the plugin, at its version (test_packaging checks they are
# equal); a literal, so the wheel builds without the plugin installed.
__version__ = "0.2.0"
