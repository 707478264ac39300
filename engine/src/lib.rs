//! Sans-IO DeepSeek-V4 engine.
