"""Grammars shared by the structured-output unit tests: a JSON schema with a nested object,
and a structural tag for one function call."""

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
