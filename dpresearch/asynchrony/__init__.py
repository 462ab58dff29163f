"""Asynchronous training: a parameter server and K workers that push gradients computed on
the parameters they last pulled, so an update may use a gradient τ versions old.

Pieces, one job each:
- `options.py`: the `async` config node (schema and one-line checks);
- `speed.py`: seeded per-worker compute-time models (constant, exponential, lognormal, uniform,
  fixed slowdowns, transient stragglers);
- `protocol.py`: when the server applies gradients and which workers may start computing
  (asgd, ssp, softsync, sync: classes chosen by `_target_`, the `protocol` config group);
- `staleness.py`: staleness-aware learning rates, the τ statistics and histograms;
- `server.py`: the server's model and optimizer, applying pushes by protocol and policy;
- `clock.py`: the simulated clock, an event queue of push arrivals;
- `transport.py`: how pushes reach the server and pulls the workers — the event simulator in one
  process, or real ranks through the communicator's messages (`open_transport` picks one);
  what a worker pushes (its gradient, or a compressed one with its own error-feedback memory)
  goes through a `compress.Channel`.

The algorithms using these pieces are `dpresearch.algorithms.async_sgd.AsyncSGD` (the server's
side, over either transport) with `AsyncWorker` (a worker's side on real ranks), its subclass
`dpresearch.algorithms.async_local_sgd.AsyncLocalSGD` (H local steps per push, an outer
optimizer on the server; simulated), and `dpresearch.algorithms.adpsgd.ADPSGD`; this package
imports nothing of `algorithms`.
"""
