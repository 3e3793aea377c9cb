package feed

import (
	"errors"
	"fmt"
	"strconv"

	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/sign"
)

// ErrInvalidConfig is wrapped by every configuration error.
var ErrInvalidConfig = errors.New("caughtup/feed: invalid configuration")

// ErrClosed is returned by Publish after Close: replay.ErrFeedClosed, as
// every replay.FeedSender returns it.
var ErrClosed = replay.ErrFeedClosed

// DefaultFeed is the feed name when a config leaves it empty.
const DefaultFeed = "default"

// checkFeed: feed names go into Redis key names and hash tags, so the
// same safe characters as key IDs (no braces, no colons).
func checkFeed(name string) error {
	if name == "" || len(name) > MaxKeyIDLen || !sign.Token(name) {
		return fmt.Errorf("%w: feed name %q: use 1–%d characters from A–Z a–z 0–9 . _ -", ErrInvalidConfig, name, MaxKeyIDLen)
	}
	return nil
}

// hashTag starts every key and the channel of a feed, so that in a Redis
// Cluster they all hash to one slot (MULTI over several keys works) and
// one ACL pattern covers them.
func hashTag(feed string) string { return "{caughtup.feed." + feed + "}" }

// ChannelName is the pub/sub channel a feed's observations are published
// on, e.g. "{caughtup.feed.default}:obs". Useful for watching it with
// redis-cli SUBSCRIBE.
func ChannelName(feed string) string { return hashTag(feed) + ":obs" }

// indexKey is the set of the value keys publishers have written. It
// expires with the values when every publisher stops.
func indexKey(feed string) string { return hashTag(feed) + ":index" }

// valueKey is where one publisher stores its latest observation of one
// node. Keyed by publisher name too, so that a stalled publisher coming
// back cannot overwrite another's newer value; a restarted publisher of
// the same name replaces its predecessor's. Each name is length-prefixed,
// so no two nodes share a key whatever characters their names contain.
func valueKey(feed, publisher string, o *Observation) string {
	b := make([]byte, 0, 64+len(publisher)+len(o.Database)+len(o.Node))
	b = append(b, hashTag(feed)...)
	b = append(b, ":latest:"...)
	for _, s := range [...]string{publisher, o.Database, o.Role.String(), o.Node} {
		b = strconv.AppendInt(b, int64(len(s)), 10)
		b = append(b, ':')
		b = append(b, s...)
		b = append(b, ':')
	}
	return string(b[:len(b)-1])
}

// PublisherACL returns the Redis 7 ACL rules a feed publisher needs: it
// writes the feed's keys (SET, SADD, PEXPIRE) and publishes on its
// channel, and nothing else. Use it after the user name, state and
// password:
//
//	ACL SETUSER caughtup-feed-pub on >secret resetkeys resetchannels -@all ~{caughtup.feed.default}:* &{caughtup.feed.default}:obs +set +sadd +pexpire +publish +spublish +ping
//
// +spublish is the sharded PUBLISH that publishers use in a Redis Cluster
// (docs/feed.md); there a go-redis ClusterClient also needs +cluster|slots
// to read the slot map.
//
// go-redis sends CLIENT SETINFO when it connects and ignores a refusal;
// on Redis 7.2 and later, where the command exists, add +client|setinfo
// (or set DisableIdentity in the client's options) to keep the refusals
// out of ACL LOG.
func PublisherACL(feed string) string {
	t := hashTag(feed)
	return "resetkeys resetchannels -@all ~" + t + ":* &" + ChannelName(feed) +
		" +set +sadd +pexpire +publish +spublish +ping"
}

// SubscriberACL returns the Redis 7 ACL rules a feed subscriber needs: it
// reads the feed's keys (read-only key permission %R~, so no write
// command could touch them even if one were allowed) and subscribes to
// its channel:
//
//	ACL SETUSER caughtup-feed-sub on >secret resetkeys resetchannels -@all %R~{caughtup.feed.default}:* &{caughtup.feed.default}:obs +get +pttl +smembers +multi +exec +subscribe +unsubscribe +ssubscribe +sunsubscribe +ping
//
// +ssubscribe and +sunsubscribe are the sharded pub/sub subscribers use
// in a Redis Cluster.
func SubscriberACL(feed string) string {
	t := hashTag(feed)
	return "resetkeys resetchannels -@all %R~" + t + ":* &" + ChannelName(feed) +
		" +get +pttl +smembers +multi +exec +subscribe +unsubscribe +ssubscribe +sunsubscribe +ping"
}

// BudgetACL returns the Redis 7 ACL rules that a Budget with the given
// key prefix (BudgetConfig.Prefix; empty for the default) needs on top
// of a role's other rules: the GCRA script (EVALSHA, EVAL on first use)
// and the commands it runs (GET, SET, TIME) on the budget's keys only.
// redis_rate puts "rate:" before every key.
//
//	ACL SETUSER caughtup-router ... ~rate:caughtup.budget.* +evalsha +eval +get +set +time
//
// Combine it with SubscriberACL by appending: the subscriber's %R~
// pattern stays read-only, and the budget's keys get read and write.
func BudgetACL(prefix string) string {
	if prefix == "" {
		prefix = DefaultBudgetPrefix
	}
	return "~" + budgetRedisPrefix + prefix + "* +evalsha +eval +get +set +time"
}
