"""The papers' setups are the papers': their degrees, GPUs and batches as
tests/reference/paper_setups.json records them (the papers' tables, transcribed), and each a
request its cluster can run."""

import json
from pathlib import Path

import pytest

from vlmcompile import models
from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.planning.setups import SETUPS, setup

REFERENCE = Path(__file__).resolve().parents[1] / "reference" / "paper_setups.json"


@pytest.fixture(scope="module")
def papers():
    return json.loads(REFERENCE.read_text())


def test_the_optimus_weak_scaling_setups_are_the_papers(papers):
    for row in papers["optimus"]["weak_scaling"]:
        ours = SETUPS[f"optimus-weak-{row['name'].split()[-1]}"]
        theirs = row["megatron_balanced"]
        par = ours.parallel
        assert (par.dp, par.tp, par.pp, par.v) == (theirs["dp"], theirs["tp"], theirs["pp"], theirs["v"])
        assert Cluster.preset(ours.cluster).num_gpus == row["gpus"]
        assert ours.global_batch == row["global_batch"]
        assert ours.microbatch_size == papers["optimus"]["microbatch_size"]


def test_the_omnibal_setups_are_the_papers(papers):
    for row in papers["omnibal"]["setups"]:
        ours = next(s for s in SETUPS.values() if s.paper == "OmniBal" and s.name.endswith(row["llm"]))
        assert (ours.parallel.tp, ours.parallel.pp, ours.parallel.dp) == (row["tp"], row["pp"], row["dp"])


@pytest.mark.parametrize("name", list(SETUPS))
def test_every_setup_is_a_request_its_cluster_runs_on_a_zoo_model(name):
    s = setup(name)
    s.request().check_on(Cluster.preset(s.cluster))
    assert models.config(s.model).name  # a zoo model by that name
    assert s.request(v=1).parallel.v == 1


def test_an_unknown_setup_names_the_known_ones():
    with pytest.raises(KeyError, match="unknown setup 'optimus-weak-Z'; choose one of optimus-weak-A"):
        setup("optimus-weak-Z")
