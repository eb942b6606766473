"""`xladist.experimental`: the names tf.distribute keeps under `experimental`.

`MultiWorkerMirroredStrategy` is the class `xladist.MultiWorkerMirroredStrategy`
itself (TF keeps the experimental endpoint for old code, and an instance of
either passes `isinstance` checks against both).
"""

from xladist import coordinator, partitioners
from xladist.communication_options import CommunicationImplementation, CommunicationOptions
from xladist.run_options import ValueContext
from xladist.sharding_options import ShardingOptions
from xladist.strategies.central_storage import CentralStorageStrategy
from xladist.strategies.multi_worker import MultiWorkerMirroredStrategy
from xladist.strategies.parameter_server import ParameterServerStrategy
from xladist.strategies.tpu import DeviceAssignment

__all__ = [
  "CentralStorageStrategy",
  "CommunicationImplementation",
  "CommunicationOptions",
  "DeviceAssignment",
  "MultiWorkerMirroredStrategy",
  "ParameterServerStrategy",
  "ShardingOptions",
  "ValueContext",
  "coordinator",
  "partitioners",
]
