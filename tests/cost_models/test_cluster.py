"""Cluster presets and the errors for inconsistent ones."""

import pytest

from vlmcompile.cost_models.cluster import PAPER_PRESETS, Cluster
from vlmcompile.cost_models.hardware import DEVICES, device
from vlmcompile.ir.errors import ClusterError


@pytest.mark.parametrize("name", list(PAPER_PRESETS))
def test_every_paper_cluster_is_a_preset(name):
    cluster = Cluster.preset(name)
    assert cluster.num_gpus == int(name.split("x")[1])
    assert cluster.num_gpus % cluster.gpus_per_node == 0
    assert cluster.device.name in DEVICES


def test_presets_carry_the_paper_hardware():
    assert Cluster.preset("h100x512").device.peak_flops_per_s == 989e12
    assert Cluster.preset("a100x32").device.mem_bytes == 80 * 10**9
    v100 = Cluster.preset("v100x64")
    assert v100.device.name == "V100-16GB" and v100.num_nodes == 8
    # DistMM: 25 Gb/s per node shared by 8 GPUs
    assert v100.inter_node_bw_bytes_per_s == pytest.approx(25e9 / 8 / 8)


def test_local_cpu_ranks_measure_this_machine():
    cluster = Cluster.preset("cpu:2")
    assert cluster.num_gpus == 2 and cluster.device.name == "cpu"
    assert cluster.device.peak_flops_per_s > 1e8  # any CPU does a GEMM faster than this
    assert "measured" in cluster.device.source


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("tpu-v5x8", "unknown cluster preset 'tpu-v5x8'; use <family>x<GPUs>"),
        ("h100", "unknown cluster preset"),
        ("h100x12", "12 GPUs do not fill nodes of 8; use a multiple of 8 \\(e.g. 8 or 16\\)"),
        ("cpu:0", "not a positive number"),
    ],
)
def test_unknown_or_inconsistent_presets_say_what_to_change(name, message):
    with pytest.raises(ClusterError, match=message):
        Cluster.preset(name)


def test_gpus_not_divisible_by_tp_times_pp():
    cluster = Cluster.preset("h100x64")
    assert cluster.data_parallel_size(8, 4) == 2
    with pytest.raises(
        ClusterError,
        match=r"tp x pp = 8 x 3 = 24 does not divide the 64 GPUs of h100x64; with tp=8 choose pp in \[1, 2, 4, 8\]",
    ):
        cluster.data_parallel_size(8, 3)
    with pytest.raises(ClusterError, match="tensor-parallel size 16 spans nodes of 8 GPUs"):
        cluster.check_tensor_parallel(16)


def test_groups_inside_a_node_use_nvlink_and_across_nodes_the_network():
    cluster = Cluster.preset("h100x64")
    assert cluster.group_link(8, 1)[0] == cluster.intra_node_bw_bytes_per_s
    assert cluster.group_link(2, 8)[0] == cluster.inter_node_bw_bytes_per_s
    assert cluster.group_link(2, 4)[0] == cluster.intra_node_bw_bytes_per_s


def test_unknown_device_is_named():
    with pytest.raises(ClusterError, match="unknown device 'B200'"):
        device("B200")
