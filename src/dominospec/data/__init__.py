"""Conversation data: reading sources, chat rendering with loss masks, the prepared dataset and the prepare stage."""
