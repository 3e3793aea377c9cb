package kafka

import kafkago "github.com/segmentio/kafka-go"

// Crash stops a running consumer the way a killed process would, as far
// as the group's offsets are concerned: nothing more is committed, not
// even what is already done.
func (c *Consumer) Crash() { c.crash() }

// SetAfterRepublish installs a hook called after a message was
// republished to the retry topic and before its offset is marked done.
// Set it before Run.
func (c *Consumer) SetAfterRepublish(f func(kafkago.Message)) { c.afterRepublish = f }
