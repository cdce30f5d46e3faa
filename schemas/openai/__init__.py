"""OpenAI's wire shapes, in one package that the gateway and the workers both
import: the request bodies Conveyor accepts (``requests``, ``responses``,
``files``), their conversion into the pipeline's ``Generation``
(``generations``), and the response and chunk objects answers are made of
(``chunks``). A batch line is checked by the same models the HTTP API uses, so
a line the API would refuse fails the same way in a batch."""
