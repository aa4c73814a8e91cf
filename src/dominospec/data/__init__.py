"""Conversation data: reading sources, chat rendering with loss masks, the prepare and regenerate stages."""
