//! dKV: the KV block transfer engine. Arrives with the disaggregated-cluster issue; the engine's KV block layout is already designed for it (see ARCHITECTURE.md).
