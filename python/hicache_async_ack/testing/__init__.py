"""Test support, named as such: a real UnifiedRadixCache around a simulated
cache controller, the traffic model, a fake MIN collective, the CP x TP layout,
and seeded scenarios for real-gloo and in-process ranks. Used by the test suite
and by ``hicache-async-ack bench``; never by the plugin itself."""
