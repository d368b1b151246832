"""firsttoken's entry points: the command line, the HTTP API and the embedded runner.

They sit above every other package: they wire `pipeline` (queue, store, producer) to `workers`
(the engine and the GPU worker), so that `pipeline` never imports `workers`.
"""
