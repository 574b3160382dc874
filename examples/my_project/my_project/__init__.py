"""An example of a user's own project for zerotrain: a model factory and a data factory.

Submitted from its folder with ``zerotrain submit examples/my_project/job.yaml``: the job's
``runtime.working_dir: .`` ships this folder with the job (docs/user-code.md).
"""
