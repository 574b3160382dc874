"""Object storage both sides use, without torch: the control plane and the workers import it at module level.

``storage``      one fsspec filesystem behind a URI (``file://``, ``s3://`` + endpoint override),
                 ranged reads, streamed writes, atomic small writes, idempotent deletion
``stfile``       the safetensors file format: dtypes, header, incremental writing
``manifest``     the checkpoint layout: directory names, the manifest, what is committed
``shared``       a ``file://`` root proven to be one filesystem for the control plane and every rank
``credentials``  a job's scoped storage credentials, fetched from the control plane by botocore's
                 ``credential_process`` (``python -m storage.credentials``)

The checkpoint protocol built on these is ``workers.checkpointing``.
"""
