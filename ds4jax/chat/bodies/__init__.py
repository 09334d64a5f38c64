"""The request bodies of the three APIs, declared once as typed models (pydantic): validated
at the edge before any engine work, published by `GET /openapi.json`, fuzzed by the suite
(schemathesis). `common` holds what they share; `anthropic` and `openai` the bodies."""
