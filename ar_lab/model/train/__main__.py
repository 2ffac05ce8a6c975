"""``python -m ar_lab.model.train --preset NAME``: train a shipped checkpoint (``presets.main``)."""

from ar_lab.model.train.presets import main

if __name__ == "__main__":
    main()
