package feed_test

import (
	"fmt"
	"strings"

	"github.com/caughtup/caughtup/feed"
)

// Keys are kept as "id:base64secret" (Export), e.g. in a secret store,
// and read back with ParseKeys on every publisher and router. Printing a
// key never shows its secret.
func Example_keys() {
	k, _ := feed.GenerateKey("2025-06")
	keys, err := feed.ParseKeys(k.Export())
	fmt.Println(len(keys), err, strings.HasPrefix(k.Export(), "2025-06:"))
	fmt.Println(keys[0])
	// Output:
	// 1 <nil> true
	// sign.Key{ID: 2025-06, Secret: [redacted]}
}

// The ACL rules of the feed named "default": one user for publishers, one
// for routers (subscriber and fleet budget).
func Example_acl() {
	fmt.Println("ACL SETUSER caughtup-feed-pub on >PUBSECRET", feed.PublisherACL("default"))
	fmt.Println("ACL SETUSER caughtup-router on >SUBSECRET", feed.SubscriberACL("default"), feed.BudgetACL(""))
	fmt.Println(feed.ChannelName("default"))
	// Output:
	// ACL SETUSER caughtup-feed-pub on >PUBSECRET resetkeys resetchannels -@all ~{caughtup.feed.default}:* &{caughtup.feed.default}:obs +set +sadd +pexpire +publish +spublish +ping
	// ACL SETUSER caughtup-router on >SUBSECRET resetkeys resetchannels -@all %R~{caughtup.feed.default}:* &{caughtup.feed.default}:obs +get +pttl +smembers +multi +exec +subscribe +unsubscribe +ssubscribe +sunsubscribe +ping ~rate:caughtup.budget.* +evalsha +eval +get +set +time
	// {caughtup.feed.default}:obs
}
