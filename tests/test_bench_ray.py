"""The Ray bench's reading of a Ray job's output (the lab run itself is `python -m bench.ray`)."""

from bench.ray import cluster_up, connected_at, rank_lines, trials_in


def test_a_ray_jobs_lines_are_read_by_rank_and_the_figures_found():
    out = ("[rank 0] [swarmd] Ray cluster up: 3 node(s), head 10.77.0.1:20123, in 9.1 s\n"
           "swarmctl: job 1a2b running\n[rank 0] CONNECTED 1795000000.125\n[rankx] CONNECTED 1.0\n"
           "[rank 0] 12 trials in 48.3 s\n[rank 0] trials by node: 10.77.0.1=4, 10.77.0.2=4\n")
    lines = rank_lines(out)
    assert list(lines) == [0] and len(lines[0]) == 4
    assert connected_at(lines[0]) == 1795000000.125
    assert cluster_up(lines[0]) == (3, 9.1)
    assert trials_in(lines[0]) == (12, 48.3)


def test_lines_that_only_look_like_the_figures_are_not_taken():
    assert connected_at(["CONNECTED soon", "CONNECTED 1 2"]) is None
    assert connected_at(["print CONNECTED 5.0"]) is None
    assert cluster_up(["Ray cluster up: 3 node(s), head h, in 9.1 s"]) is None  # not swarmd's own line
    assert trials_in(["12 trials in many s", "trials in 4.0 s"]) is None
