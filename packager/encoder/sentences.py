"""The fixed sentence set every encoder candidate is measured on.

Paraphrase pairs and near misses across topics, so each sentence has a meaningful nearest neighbour
(the neighbour-agreement figure), plus paragraphs past 128 tokens (the length the shipped tokenizer of
all-MiniLM-L6-v2 truncated at) so long inputs are checked too.
"""

from __future__ import annotations

_PARAGRAPH = (
    "The committee met on Tuesday to review the annual budget, which had grown by nearly twelve percent "
    "compared with the previous year, largely because of rising energy prices, new hires in the research "
    "department, and the long-delayed renovation of the east wing of the main building. Several members "
    "argued that the renovation should be postponed again, pointing out that the contractor had already "
    "missed two deadlines and that the estimates had doubled since the project was first proposed. Others "
    "replied that further delays would only raise costs, and that the building's heating system was close "
    "to failing entirely. After a long discussion the committee agreed to approve the budget on the "
    "condition that a detailed schedule for the renovation be presented at the next meeting."
)

SENTENCES: tuple[str, ...] = (
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A woman is holding an infant in her arms.",
    "A man is riding a horse.",
    "Someone rides a horse across an open field.",
    "A monkey is playing drums.",
    "A chimpanzee hits a drum kit with sticks.",
    "Two men pushed carts through the woods.",
    "A pair of men push wheelbarrows along a forest path.",
    "The new movie is awesome.",
    "That film was fantastic, I loved it.",
    "The stock market fell sharply after the announcement.",
    "Shares dropped steeply once the news was released.",
    "How do I reset my password?",
    "I forgot my password and cannot log in to my account.",
    "The recipe calls for two cups of flour and a pinch of salt.",
    "Mix flour with a little salt before adding the eggs.",
    "Heavy rain is expected across the region tomorrow.",
    "The forecast says it will pour all day tomorrow.",
    "Python is a popular programming language for data science.",
    "Many data scientists write their analyses in Python.",
    "The train to Berlin leaves at half past eight.",
    "Our flight to Madrid was delayed by three hours.",
    "She plays the violin in the city orchestra.",
    "He has been learning to play the cello for a year.",
    "The patient was given antibiotics for the infection.",
    "Doctors prescribed medicine to treat the bacterial illness.",
    "Photosynthesis converts sunlight into chemical energy.",
    "Plants use light to turn carbon dioxide and water into sugar.",
    "The quick brown fox jumps over the lazy dog.",
    "A fast auburn fox leapt above a sleepy hound.",
    "Paris is the capital of France.",
    "Berlin is the capital city of Germany.",
    "Customers can return items within thirty days of purchase.",
    "Our refund policy allows returns for a month after buying.",
    _PARAGRAPH,
    "The committee approved the budget after debating whether the costly, delayed renovation of the east wing "
    "should go ahead, asking for a detailed schedule at its next meeting. " * 3,
    "ok",
    "Transformers process all tokens of a sentence in parallel using self-attention.",
)
