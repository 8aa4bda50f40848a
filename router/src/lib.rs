//! Router: the OpenAI HTTP API, admission and KV-aware routing. Arrives with the serve and cluster issues.
