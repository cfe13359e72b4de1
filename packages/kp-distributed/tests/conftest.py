"""The suite's longest tests start first (CI's 2 workers, one test a dispatch: noxfile's LONGEST_FIRST), so that
the other worker runs the short ones meanwhile instead of the long ones holding the run's end."""

# seconds each on CI's 2 cores (interpreted kernels, spawned ranks), 2026-12-02
SLOWEST = (
    "test_kp_kernels_and_float8_all_gather_under_shard",  # 87
    "test_a_killed_rank_resumes_from_the_last_checkpoint",  # 27
    "test_hugging_face_model_patched_by_kp_norms_and_kp_attention_under_shard",  # 25
    "test_kill_9_mid_run_resumes_bit_identical",  # 18
    "test_resume_continues_the_same_losses",  # 17
)


def pytest_collection_modifyitems(items):
    def rank(item):
        name = item.name.split("[")[0]
        return SLOWEST.index(name) if name in SLOWEST else len(SLOWEST)

    items.sort(key=rank)  # stable: the others keep their order
