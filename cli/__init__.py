"""``conveyor``, the command line: the roof of the tree. It may import every
package (it starts the layers, workers and gateway, and reads the log for
inspect, replay and the dead letters); nothing imports it."""
