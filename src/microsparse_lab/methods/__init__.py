"""The averaging methods the harness trains, benchmarks and simulates, by name.

- :mod:`.names`: the method grammar (``micro``, ``micro@ddp``, ``powersgd(rank=4)``, ...) and
  the sparsifier variants (``micro(selection=threshold)``, ``micro-reference``);
- :mod:`.hooks`: attaching a method to a model (microsparse's DDP hook, torch's peers);
- :mod:`.traffic`: what the peers send per step, from the model's layer shapes;
- :mod:`.powersgd`: torch's PowerSGD hook with a state that checkpoints resume.
"""
