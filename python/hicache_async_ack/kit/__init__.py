"""The SGLang adapter kit every sync (feature) is built on; speaks SGLang's
vocabulary, imports torch only inside the functions that need it.

- :mod:`.feature`: the Feature protocol, the state base, the path announcement,
  the Rider protocol (a section riding the ack sync's reduce);
- :mod:`.decision`: a path decision and its bounded reason codes;
- :mod:`.groups`: the groups upstream reduces over, the one a reduce can stand for;
- :mod:`.collectives`: the collectives the features run (installable);
- :mod:`.queues`: views of a controller's queues;
- :mod:`.hooks`: marking, finding and registering our hooks.
"""
