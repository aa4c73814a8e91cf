"""The model card: the exported draft's README.md, written after the evaluation it quotes.

  render.py  config.json + params + metrics documents -> the card's Markdown
  stage.py   the `card` stage: which documents describe these weights, then the card written into paths.draft
"""
