"""Sample job specs (``*.yaml``) and ``python -m examples.demo``, the ``make demo`` walkthrough."""
