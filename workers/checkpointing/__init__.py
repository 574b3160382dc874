"""Sharded checkpoints in object storage, split by responsibility.

Torch-free (the CLI's ``verify``/``consolidate``/``list`` import only these):

``storage``      one fsspec filesystem behind a URI (``file://``, ``s3://`` + endpoint override),
                 ranged reads, streamed writes, atomic small writes, idempotent deletion
``stfile``       the safetensors file format: dtypes, header, incremental writing
``manifest``     the checkpoint layout: directory names, the manifest, what is committed
``verify``       every file against the manifest's sizes and sha256
``consolidate``  one ordinary weights file, streamed chunk by chunk in bounded memory
``retention``    ``keep_last``: decommit, delete objects, then forget the record
``shared_storage``  a ``file://`` root proven to be one filesystem for the control plane and every rank

With torch (the training side):

``snapshot``     this rank's engine state -> shard tensors + where each piece lies (the only
                 part that blocks the training loop: the device -> host copy)
``writer``       background upload, the commit protocol (rank 0 writes the manifest last)
``reader``       resharding load: each rank reads only the byte ranges its new shard needs

``workers.checkpoint`` is the public face (``CheckpointManager`` and the train-loop hook).
Nothing here imports torch at package import time.
"""
