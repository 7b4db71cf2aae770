"""`b12x serve`: the OpenAI API over one serving engine (FastAPI on uvicorn)."""
