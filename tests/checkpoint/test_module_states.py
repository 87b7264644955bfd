"""The module-shaped state dicts of weight averaging are found in Lightning's checkpoint dict and taken
out of a copy, leaving the checkpoint the callbacks hold untouched."""

import torch

from lightning_parallel.checkpoint.module_states import at, places, replaced


def test_places_of_the_module_weights_and_of_swas_average_and_taking_them_out_of_a_copy():
    weights, average = {"w": torch.ones(2)}, {"w": torch.zeros(2)}
    checkpoint = {"state_dict": {"w": torch.full((2,), 0.5)}, "current_model_state": weights,
                  "callbacks": {"ModelCheckpoint{}": {"best_model_path": ""},
                                "StochasticWeightAveraging{}": {"n_averaged": 1, "average_model_state": average}}}
    found = places(checkpoint)
    assert found == [("current_model_state",), ("callbacks", "StochasticWeightAveraging{}", "average_model_state")]
    assert [at(checkpoint, place) for place in found] == [weights, average]
    rest = checkpoint
    for place in found:
        rest = replaced(rest, place, None)
    assert places(rest) == []
    assert rest["callbacks"]["StochasticWeightAveraging{}"] == {"n_averaged": 1, "average_model_state": None}
    assert checkpoint["current_model_state"] is weights and places(checkpoint) == found  # the original is kept
    assert places({"state_dict": {}, "callbacks": {"SWA": {"average_model_state": None}}}) == []
