"""`xladist.experimental`: the names tf.distribute keeps under `experimental`."""

from xladist.communication_options import CommunicationImplementation, CommunicationOptions
from xladist.input_options import ValueContext

__all__ = ["CommunicationImplementation", "CommunicationOptions", "ValueContext"]
