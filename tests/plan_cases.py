"""What the memory plan's tests share: a model realized and taken through a step, an evaluation and
a step after it, so that both compute buffers exist and the training graph is back in its place."""

from __future__ import annotations

from toyharness.runner import batch_for


def stepped_model(pm, engine, options, data):
    """The recipe's model after step 0, an evaluation and step 1."""
    model = pm.hook.realize(engine=engine, options=options, data=data)
    row = pm.hook.hp(options=options, step=0)
    pm.hook.step(model=model, batch=batch_for(data, "train", 0, options), hp=row)
    pm.hook.evaluate(model=model, batch=batch_for(data, "eval", 0, options))
    pm.hook.step(model=model, batch=batch_for(data, "train", 1, options), hp=row)
    return model
