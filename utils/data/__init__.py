"""Reading data: local files and their formats (`file_formats`), a run's splits from the hub or files
(`loaders`), token columns read in place from the `datasets` cache (`arrow_columns`), which examples make
each batch (`batch_order`), and streamed text: its sources (`text_sources`), the background stream
(`stream`) and its first examples read whole (`stream_head`).

Imports only `utils.base`. Nothing here knows devices or models: batches leave as host arrays.
"""
