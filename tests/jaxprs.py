"""What a traced program holds: its equations, inside nested programs (checkpoints, scans, jits) too."""


def label(eqn):
    """An equation's primitive, jax.checkpoint's named for what it keeps: all recomputed, or a policy's choice."""
    if eqn.primitive.name == "remat2":
        return "checkpoint" if eqn.params["policy"] is None else "checkpoint[policy]"
    return eqn.primitive.name


def equations(jaxpr, where=()):
    """(the scans and checkpoints it sits in, its label) of every equation of `jaxpr`, inside other equations
    too (not inside a Pallas kernel: its own loops are not the model's)."""
    for eqn in jaxpr.eqns:
        name = label(eqn)
        yield where, name
        if name == "pallas_call":
            continue
        inner = where + (name,) if name.startswith(("scan", "checkpoint")) else where
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    yield from equations(sub, inner)
