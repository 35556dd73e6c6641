"""Grammars shared by the structured-output unit tests: a JSON schema with a nested object,
a structural tag for one function call, and regex grammars over a six-token vocabulary."""

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "address": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
    "required": ["name"],
}

STRUCTURAL_TAG = {
    "structures": [{"begin": "<function=get_weather>",
                    "schema": {"type": "object", "properties": {"city": {"type": "string"}}},
                    "end": "</function>"}],
    "triggers": ["<function="],
}

TOY_VOCAB = ["a", "b", "c", "x", "y", "</s>"]  # token 5 ends a constrained output


def toy_grammar(regex: str):
    """A compiled, activated GrammarState for `regex` over TOY_VOCAB (real xgrammar)."""
    from concurrent.futures import Future

    import xgrammar as xgr

    from pdserve.engine.structured_output import GrammarState

    info = xgr.TokenizerInfo(TOY_VOCAB, stop_token_ids=[5])
    compiled: Future = Future()
    compiled.set_result(xgr.GrammarCompiler(info, max_threads=1).compile_regex(regex))
    state = GrammarState(compiled)
    assert state.activate([])
    return state
