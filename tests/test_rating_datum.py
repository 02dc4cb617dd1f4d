"""A rating's KTO datum covers where the reply stopped: replies that ended with ``stop`` get SmolLM2's
end-of-turn token (``<|im_end|>``, id 2) appended, truncated (``length``) replies are trained as served."""

from __future__ import annotations

from livelora.clients.types.signals import RatingEvent
from livelora.trainer.online import OnlineTrainer
from livelora.trainer.scheduler import Batch


def _rating(finish_reason, completion):
    return RatingEvent(
        id="feedback-1",
        endpoint="ep",
        created=0,
        completion_id="chatcmpl-1",
        prompt_token_ids=[1, 9690, 198],
        completion_token_ids=completion,
        rating=True,
        rating_key="chatcmpl-1:/",
        finish_reason=finish_reason,
    )


def test_stop_replies_train_on_the_end_of_turn_token(base_ref, tokenizer, tmp_path):
    trainer = OnlineTrainer(base_ref, tmp_path)
    eos = tokenizer.eos_token_id
    assert tokenizer.convert_ids_to_tokens(eos) == "<|im_end|>" and eos == 2
    assert trainer.rated_completion(_rating("stop", [4, 5])) == [4, 5, 2]
    assert trainer.rated_completion(_rating("stop", [4, 2])) == [4, 2]  # already there: not twice
    assert trainer.rated_completion(_rating("length", [4, 5])) == [4, 5]
    assert trainer.rated_completion(_rating(None, [4, 5])) == [4, 5]  # older events: as served
    batch = Batch("ep", "kto", [_rating("stop", [4, 5]), _rating("length", [7])], ["1-0", "2-0"])
    data, loss_fn, _, _ = trainer.datums(batch)
    assert loss_fn == "kto"
    # tokens[1:] of prompt + completion: the stop reply's targets end with <|im_end|>, weight 1
    assert data[0].loss_fn_inputs["target_tokens"].data == [9690, 198, 4, 5, 2]
    assert data[0].loss_fn_inputs["weights"].data == [0.0, 0.0, 1.0, 1.0, 1.0]
    assert data[1].loss_fn_inputs["target_tokens"].data == [9690, 198, 7]
