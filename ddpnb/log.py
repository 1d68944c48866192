"""The package's one logger; handlers are the application's business."""

import logging

logger = logging.getLogger("ddpnb")
