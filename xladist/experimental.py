"""`xladist.experimental`: the names tf.distribute keeps under `experimental`."""

from xladist.input_options import ValueContext

__all__ = ["ValueContext"]
