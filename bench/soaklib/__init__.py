"""The soak with faults, shared by ``bench/soak.py`` (SmolLM2 through ``devin-compile serve``) and
``tests/test_soak.py`` (the tiny model on an in-process server).

- :mod:`.plan`: the request plan (workload rows, the fault mix, what each request expects);
- :mod:`.malformed`: the malformed bodies and the 4xx each must get;
- :mod:`.wire`: a small HTTP/1.1 client on asyncio streams (exact bytes out, events in, hang up at will);
- :mod:`.client`: one request of the plan, streamed or not, cut off or not, timed;
- :mod:`.observe`: ``/metrics``, idle, ``/health``, resident memory;
- :mod:`.driver`: the whole soak with bounded concurrency, faults fired at fractions of it;
- :mod:`.reference`: the in-process answers of the same model;
- :mod:`.checks`: outcomes against expectations, percentiles, ``/metrics`` and resident memory.
"""
