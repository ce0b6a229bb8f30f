"""The engine-agnostic protocol: the pipelined MIN-reduce (:mod:`.reduce`), the
stamp every reduce carries (:mod:`.stamp`), auto depth (:mod:`.depth`) and the
prefetch votes' book (:mod:`.votes`). Imports neither SGLang nor torch."""
