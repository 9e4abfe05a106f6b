from ..core import RequestOutput as RequestOutput
from ..core import Sequence as Sequence
