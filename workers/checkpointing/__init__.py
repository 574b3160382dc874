"""Sharded checkpoints in object storage, split by responsibility.

The storage they write to, the file format and the checkpoint layout are the top-level
``storage`` package (``storage.storage``, ``storage.stfile``, ``storage.manifest``), which the
control plane imports too.

Torch-free (the CLI's ``verify``/``consolidate``/``list`` import only these):

``verify``       every file against the manifest's sizes and sha256
``consolidate``  one ordinary weights file, streamed chunk by chunk in bounded memory
``retention``    ``keep_last``: decommit, delete objects, then forget the record

With torch (the training side):

``snapshot``     this rank's engine state -> shard tensors + where each piece lies (the only
                 part that blocks the training loop: the device -> host copy)
``writer``       background upload, the commit protocol (rank 0 writes the manifest last)
``reader``       resharding load: each rank reads only the byte ranges its new shard needs

``workers.checkpoint`` is the public face (``CheckpointManager`` and the train-loop hook).
Nothing here imports torch at package import time.
"""
