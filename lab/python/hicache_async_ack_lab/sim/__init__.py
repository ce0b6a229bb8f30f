"""What the bench and the tests drive: a real UnifiedRadixCache around a
simulated cache controller (``cache``), its storage prefetches (``prefetch``) and
the PD decode offload manager (``offload``), the traffic model, the fake MIN
collective and latency model (``collectives``), a model clock (``clock``) and the
attention CP x TP layout (``layout``). Never used by the plugin itself."""
