"""Ray's memory monitor report names every process on the node, other users' jobs among them:
a job's owner sees how full the node was, never that table (service.log_text), in the job's
log (whole, tail, per rank) and in its details (the traceback behind FAILED)."""

from __future__ import annotations

from service.log_text import MEMORY_REPORT_LEFT_OUT, plain_log

from tests.helpers.service_specs import make_spec

SECRET = "python /home/bob/secret_project/train.py --api-key=bob-s3cr3t"
OTHER_TASK = "bobs_private_finetune"

# Ray 2.60's raylet (its format strings: "Memory on the node (IP: %s, ID: %s) was %sGB used /
# %sGB limit (%f)", "Considered workers: [", "%s%spid=%d, actual memory used=%sGB, worker ID=%s)",
# "Top 10 memory users: %s" with TopNMemoryDebugString's "PID\tMEM(GB)\tCOMMAND" rows), as the
# driver prints the killed worker's error: each line under the worker's prefix.
RAY_260_REPORT = "\n".join(f"\x1b[36m(RayTrainWorker pid=4242)\x1b[0m {line}" for line in [
    "ray.exceptions.OutOfMemoryError: Task was killed due to the node running low on memory.",
    "Memory on the node (IP: 127.0.0.1, ID: 5f3c9a) was 22.45GB used / 23.43GB limit (0.958173)",
    "OOM kill reason: the node's memory usage exceeds the threshold of 0.95",
    "Ray killed 1 worker(s) based on the killing policy",
    "Considered workers: [",
    "(job ID=02000000, lease ID=aa11, task name=RayTrainWorker.__init__, required resources={CPU: 1}, "
    "pid=4242, actual memory used=3.10GB, worker ID=ef56)",
    f"(job ID=03000000, lease ID=bb22, task name={OTHER_TASK}, required resources={{CPU: 4}}, "
    "pid=777, actual memory used=9.80GB, worker ID=ab78)",
    "]",
    "To see more information about memory usage on this node, use `ray logs raylet.out -ip 127.0.0.1`",
    "Top 10 memory users: PID\tMEM(GB)\tCOMMAND",
    "777\t9.80\t" + SECRET,
    "4242\t3.10\tray::RayTrainWorker.train_fn",
    "Refer to the documentation on how to address the out of memory issue: https://docs.ray.io/en/latest/"
    "ray-observability/user-guides/debug-apps/debug-memory.html.",
]) + "\n"

# ray/_private/memory_monitor.py (RayOutOfMemoryError.get_message with get_top_n_memory_usage),
# as a repr puts it in a traceback's last line: the whole report on one line.
PYTHON_REPORT = repr(
    "More than 95% of the memory on node host-1 is used (22.45 / 23.43 GB). The top 10 memory consumers are:\n\n"
    "PID\tMEM\tCOMMAND\n777\t9.8GiB\t" + SECRET + "\n4242\t3.1GiB\tray::RayTrainWorker\n\n"
    "In addition, up to 0.1 GiB of shared memory is currently being used by the Ray object store.")


def test_the_process_table_is_left_out_and_the_summary_stays():
    text = plain_log("step 9/10  loss 2.0\n" + RAY_260_REPORT + "driver: job failed\n")
    assert SECRET not in text and OTHER_TASK not in text and "777" not in text
    assert "(RayTrainWorker pid=4242) Memory on the node (IP: 127.0.0.1, ID: 5f3c9a) was 22.45GB used / " \
           "23.43GB limit (0.958173)\n" in text
    assert f"(RayTrainWorker pid=4242) Top 10 memory users: {MEMORY_REPORT_LEFT_OUT}\n" in text
    assert text.startswith("step 9/10  loss 2.0\n") and text.endswith("Refer to the documentation on how to "
        "address the out of memory issue: https://docs.ray.io/en/latest/ray-observability/user-guides/debug-apps/"
        "debug-memory.html.\ndriver: job failed\n")
    one_line = plain_log(f"OutOfMemoryError({PYTHON_REPORT})\n")
    assert SECRET not in one_line and one_line.startswith("OutOfMemoryError('More than 95% of the memory on node "
                                                          "host-1 is used (22.45 / 23.43 GB).")
    assert plain_log(text) == text  # kept copies are served through it again


def test_a_tail_that_starts_inside_the_table_shows_no_row():
    start = RAY_260_REPORT.index("777\t")
    assert SECRET not in plain_log(RAY_260_REPORT[start:])


def test_a_memory_monitor_kill_is_summarized_from_ray_260s_text():
    from ray.exceptions import OutOfMemoryError
    from ray.train import WorkerGroupError

    from workers.runtime.ray_train import failure_summary

    report = plain_log(RAY_260_REPORT.replace("\x1b[36m(RayTrainWorker pid=4242)\x1b[0m ", ""))
    summary = failure_summary(WorkerGroupError("Training failed", {0: OutOfMemoryError(RAY_260_REPORT)}))
    assert "killed by Ray's memory monitor: the node was at 96% of 23.4 GB" in summary, (summary, report)
    assert SECRET not in summary and "\n" not in summary


def test_a_failed_jobs_details_and_log_leave_the_table_out(service):
    client = service.client()
    job = client.submit(make_spec(fail=True, fail_details="Traceback (most recent call last):\n" + RAY_260_REPORT))
    failed = client.wait(job.id, timeout=60)
    assert failed.details and SECRET not in failed.details and OTHER_TASK not in failed.details
    assert "was 22.45GB used / 23.43GB limit (0.958173)" in failed.details
    whole = client.logs(job.id)
    assert "was 22.45GB used / 23.43GB limit" in whole and MEMORY_REPORT_LEFT_OUT in whole
    for text in (whole, client.logs(job.id, tail_bytes=len(RAY_260_REPORT) // 3), client.logs(job.id, rank=0)):
        assert SECRET not in text and OTHER_TASK not in text
