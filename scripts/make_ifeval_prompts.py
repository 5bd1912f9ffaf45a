#!/usr/bin/env python3
"""Writes data/ifeval_prompts.jsonl: the verifiable-instruction prompt set shipped with lorafit.

Each row pairs a task written for this project with one to three verifiable instructions
(IFEval's instruction ids and argument names, plus lorafit's `startend:start_checker`), and the
instruction's own wording appended to the task. The set is deterministic (a fixed seed): rerun
the script after editing the tasks or the templates, then `cargo test --lib eval::prompts`.

Arguments are kept within what a small instruction-tuned model can meet in a few hundred
tokens (word counts up to 150, sentences up to 8), and instructions that contradict each other
(JSON with bullet lists, all capitals with all lowercase, ...) are never combined.

    python3 scripts/make_ifeval_prompts.py > data/ifeval_prompts.jsonl
"""

import json
import random

TASKS = [
    "Write a short note to a neighbour asking them to water your plants while you are away.",
    "Explain how a rainbow forms.",
    "Describe your ideal weekend morning.",
    "Write a product description for a reusable water bottle.",
    "Give advice to someone starting to learn the guitar.",
    "Explain why the sky looks blue during the day.",
    "Write a thank-you message to a teacher who helped you.",
    "Describe how to make a cup of tea.",
    "Summarise the plot of a story about a lost dog finding its way home.",
    "Explain what a volcano is to a ten-year-old.",
    "Write a short poem about autumn leaves.",
    "Give three reasons why people enjoy gardening.",
    "Describe a busy train station at rush hour.",
    "Write an invitation to a small birthday picnic in the park.",
    "Explain how bees make honey.",
    "Write a short review of an imaginary pizza restaurant.",
    "Describe the water cycle.",
    "Give tips for staying focused while studying.",
    "Write a job advertisement for a bakery assistant.",
    "Explain the difference between weather and climate.",
    "Write a short story about a robot who learns to paint.",
    "Describe what makes a good friend.",
    "Explain how a bicycle works.",
    "Write an apology email for missing a meeting.",
    "Describe a walk along the beach at sunset.",
    "Explain why we need sleep.",
    "Write a welcome message for new members of a chess club.",
    "Give advice on packing for a weekend camping trip.",
    "Explain what photosynthesis is.",
    "Write a short speech for a school sports day.",
    "Describe the taste of a fresh strawberry.",
    "Explain how to plant a tree.",
    "Write a letter to your future self.",
    "Describe a library on a rainy afternoon.",
    "Explain why recycling matters.",
    "Write a riddle about the moon and explain its answer.",
    "Give tips for saving money on groceries.",
    "Explain how the heart pumps blood.",
    "Write a short fable about a fox and a crow.",
    "Describe a winter market in a small town.",
    "Explain what a computer program is.",
    "Write a postcard message from a holiday in the mountains.",
    "Give advice to someone moving to a new city.",
    "Explain how magnets work.",
    "Write a short biography of an imaginary inventor.",
    "Describe the sounds of a forest at night.",
    "Explain how to care for a goldfish.",
    "Write a complaint letter about a late train.",
    "Describe your favourite season and why you like it.",
    "Explain what the internet is.",
    "Write a lullaby for a sleepy kitten.",
    "Give tips for a first job interview.",
    "Explain why leaves change colour in autumn.",
    "Write a short dialogue between a cat and a dog.",
    "Describe a perfect sandwich.",
    "Explain how a lighthouse helps ships.",
    "Write a motivational message for someone training for a marathon.",
    "Describe a thunderstorm.",
    "Explain what friction is.",
    "Write a short diary entry from a sailor on a long voyage.",
    "Give advice on keeping a houseplant alive.",
    "Explain how to brew coffee with a French press.",
    "Write an announcement that the office kitchen will be closed for cleaning.",
    "Describe an old bookshop.",
    "Explain why the moon has phases.",
    "Write a short poem about the sea.",
    "Give tips for learning a new language.",
    "Explain how a refrigerator keeps food cold.",
    "Write a message congratulating a friend on a new job.",
    "Describe a hot air balloon ride.",
    "Explain what gravity does.",
    "Write a short mystery story set in a museum.",
    "Give advice on writing a good essay.",
    "Explain how clouds form.",
    "Write a recipe for a simple vegetable soup.",
    "Describe a city park in spring.",
    "Explain what a habit is and how to build one.",
    "Write a farewell message for a colleague who is retiring.",
    "Describe the life of a honeybee.",
    "Explain why exercise is good for the body.",
    "Write a short story about a dragon who is afraid of fire.",
    "Give tips for taking better photos with a phone.",
    "Explain how a seed grows into a plant.",
    "Write a review of an imaginary science fiction film.",
    "Describe a festival of lights.",
    "Explain what an ecosystem is.",
    "Write a note reminding your team about Friday's deadline.",
    "Describe a mountain village in the early morning.",
    "Explain how airplanes stay in the air.",
    "Write a poem about a city at night.",
    "Give advice on making a budget.",
    "Explain how to tie a simple knot.",
    "Write a short story about two friends building a treehouse.",
    "Describe the smell of fresh bread.",
    "Explain what a museum does.",
    "Write an email asking a library to extend a book loan.",
    "Describe a snowy day in the countryside.",
    "Explain why oceans are salty.",
    "Write a short toast for a friend's wedding.",
    "Give tips for staying calm before an exam.",
    "Explain how a compass works.",
    "Write a story about a child who finds a map in the attic.",
    "Describe a market stall selling spices.",
    "Explain what a vaccine does.",
    "Write an advertisement for a local bicycle repair shop.",
    "Describe a quiet lake in the summer.",
    "Explain how to make a paper aeroplane.",
    "Write a short letter to a pen pal in another country.",
    "Give advice on starting a small vegetable garden.",
    "Explain how the seasons happen.",
    "Write a poem about a cup of hot chocolate.",
    "Describe a day in the life of a postal worker.",
    "Explain what an atom is.",
    "Write a short story about a lighthouse keeper.",
    "Give tips for a long car journey with children.",
    "Explain how solar panels make electricity.",
    "Write a message inviting neighbours to a street clean-up.",
    "Describe a concert in an old church.",
    "Explain why people keep pets.",
    "Write a short poem about the first snow.",
    "Give advice on choosing a good book to read.",
    "Explain how a river shapes a valley.",
    "Write a story about a cat who becomes mayor of a village.",
    "Describe the view from a high tower.",
    "Explain what a budget is and why it helps.",
    "Write a short guide to visiting a zoo.",
    "Describe a kitchen during a family dinner.",
    "Explain how bread rises.",
    "Write a note to a friend recommending a podcast.",
    "Give tips for running a meeting well.",
    "Explain what a map scale means.",
    "Write a short story about a clock that runs backwards.",
    "Describe an island from the deck of a ferry.",
    "Explain why some animals hibernate.",
    "Write a welcome speech for a science fair.",
    "Give advice for a first day at a new school.",
    "Explain how a telescope lets us see far away.",
    "Write a short poem about a garden after rain.",
    "Describe a street food market at night.",
    "Explain how wind turbines work.",
    "Write an email to a hotel asking about breakfast times.",
    "Give tips for keeping a clean and tidy desk.",
    "Explain what a noun and a verb are.",
    "Write a story about a mouse who wants to fly.",
    "Describe the inside of a spaceship.",
    "Explain why it is important to drink water.",
    "Write a short message for a card to a sick friend.",
    "Give advice on preparing for a hiking trip.",
    "Explain how fireworks get their colours.",
    "Write a short poem about a train journey.",
    "Describe a school playground at break time.",
    "Explain what a calendar is and how it is organised.",
    "Write a story about a baker who bakes a cake for a giant.",
    "Give tips for learning to swim.",
    "Explain how a battery stores energy.",
]

# Yes/no questions for the constrained-response instruction.
QUESTIONS = [
    "Is it a good idea to drink water every day?",
    "Can a penguin fly?",
    "Is the sun a star?",
    "Should children learn to swim?",
    "Will it always rain in spring?",
    "Is reading before bed a good habit?",
    "Do plants need light to grow?",
    "Is chess harder than checkers?",
]

LANGUAGES = {
    "fr": "French", "es": "Spanish", "de": "German", "it": "Italian", "pt": "Portuguese",
    "ru": "Russian", "ja": "Japanese", "zh": "Chinese", "hi": "Hindi", "ar": "Arabic",
    "ko": "Korean", "nl": "Dutch", "pl": "Polish", "tr": "Turkish", "vi": "Vietnamese",
    "sw": "Swahili", "fi": "Finnish",
}
KEYWORDS = [
    "bright", "journey", "garden", "simple", "window", "river", "friend", "morning",
    "careful", "gentle", "light", "future", "quiet", "market", "story", "water",
]
FORBIDDEN = [
    "very", "really", "thing", "good", "nice", "just", "always", "never", "big", "bad",
]
END_PHRASES = [
    "Is there anything else I can help with?",
    "Any other questions?",
    "That is all for today.",
    "Let me know if you need more.",
]
START_PHRASES = ["In short", "Here is my answer", "To begin with", "Dear reader"]
REL = ["less than", "at least"]

ALL = [
    "keywords:existence", "keywords:frequency", "keywords:forbidden_words",
    "keywords:letter_frequency", "language:response_language",
    "length_constraints:number_sentences", "length_constraints:number_paragraphs",
    "length_constraints:number_words", "length_constraints:nth_paragraph_first_word",
    "detectable_content:number_placeholders", "detectable_content:postscript",
    "detectable_format:number_bullet_lists", "detectable_format:constrained_response",
    "detectable_format:number_highlighted_sections", "detectable_format:multiple_sections",
    "detectable_format:json_format", "detectable_format:title", "combination:two_responses",
    "combination:repeat_prompt", "startend:end_checker", "change_case:capital_word_frequency",
    "change_case:english_capital", "change_case:english_lowercase", "punctuation:no_comma",
    "startend:quotation", "startend:start_checker",
]

# Instructions each one must not be combined with (made symmetric below).
CONFLICTS = {
    "detectable_format:json_format": set(ALL) - {"keywords:existence", "keywords:forbidden_words"},
    "combination:two_responses": set(ALL) - {
        "keywords:existence", "keywords:forbidden_words", "language:response_language",
        "detectable_format:title", "punctuation:no_comma"},
    "combination:repeat_prompt": set(ALL) - {
        "keywords:existence", "detectable_format:title", "punctuation:no_comma"},
    "detectable_format:constrained_response": set(ALL),
    "language:response_language": {
        "detectable_format:multiple_sections", "keywords:existence", "keywords:frequency",
        "keywords:forbidden_words", "keywords:letter_frequency", "startend:end_checker",
        "startend:start_checker", "detectable_content:postscript",
        "change_case:english_capital", "change_case:english_lowercase",
        "change_case:capital_word_frequency", "length_constraints:nth_paragraph_first_word"},
    "length_constraints:number_paragraphs": {
        "length_constraints:nth_paragraph_first_word", "length_constraints:number_sentences"},
    "change_case:capital_word_frequency": {
        "change_case:english_lowercase", "change_case:english_capital"},
    "change_case:english_capital": {"change_case:english_lowercase"},
    "startend:quotation": {"detectable_format:title", "startend:start_checker"},
    "detectable_format:multiple_sections": {"detectable_format:number_highlighted_sections"},
}
for k in ALL:
    CONFLICTS.setdefault(k, set()).add(k)
for k, vs in list(CONFLICTS.items()):
    for v in vs:
        CONFLICTS.setdefault(v, set()).add(k)


def build(iid, rng, task):
    """(description, kwargs) of one instruction."""
    if iid == "keywords:existence":
        a, b = rng.sample(KEYWORDS, 2)
        return f"Include the keywords {a} and {b} in your response.", {"keywords": [a, b]}
    if iid == "keywords:frequency":
        w, n, rel = rng.choice(KEYWORDS), rng.randint(2, 4), rng.choice(REL)
        return (f"In your response, the word {w} should appear {rel} {n} times.",
                {"keyword": w, "frequency": n, "relation": rel})
    if iid == "keywords:forbidden_words":
        a, b = rng.sample(FORBIDDEN, 2)
        return (f"Do not use the words {a} or {b} anywhere in your response.",
                {"forbidden_words": [a, b]})
    if iid == "keywords:letter_frequency":
        letter, rel = rng.choice("abcdefghilmnoprstuwy"), rng.choice(REL)
        n = rng.randint(3, 12) if rel == "at least" else rng.randint(2, 6)
        return (f"In your response, the letter {letter} should appear {rel} {n} times.",
                {"letter": letter, "let_frequency": n, "let_relation": rel})
    if iid == "language:response_language":
        code = rng.choice(sorted(LANGUAGES))
        return (f"Your ENTIRE response should be in {LANGUAGES[code]}, no other language is "
                "allowed.", {"language": code})
    if iid == "length_constraints:number_sentences":
        rel = rng.choice(REL)
        n = rng.randint(4, 8) if rel == "less than" else rng.randint(2, 5)
        return (f"Your response should contain {rel} {n} sentences.",
                {"num_sentences": n, "relation": rel})
    if iid == "length_constraints:number_paragraphs":
        n = rng.randint(2, 4)
        return (f"There should be exactly {n} paragraphs. Paragraphs are separated with the "
                "markdown divider: ***", {"num_paragraphs": n})
    if iid == "length_constraints:number_words":
        rel = rng.choice(REL)
        n = rng.choice([30, 40, 50, 60, 80]) if rel == "less than" else rng.choice([20, 40, 60, 100, 150])
        return f"Answer with {rel} {n} words.", {"num_words": n, "relation": rel}
    if iid == "length_constraints:nth_paragraph_first_word":
        n = rng.randint(2, 4)
        k = rng.randint(1, n)
        w = rng.choice(["first", "today", "however", "finally", "imagine", "remember"])
        return (f"There should be exactly {n} paragraphs, and paragraphs are separated from each "
                f"other by two new lines. Paragraph {k} must start with the word {w}.",
                {"num_paragraphs": n, "nth_paragraph": k, "first_word": w})
    if iid == "detectable_content:number_placeholders":
        n = rng.randint(1, 3)
        return (f"The response must contain at least {n} placeholders in square brackets, "
                "such as [address].", {"num_placeholders": n})
    if iid == "detectable_content:postscript":
        m = rng.choice(["P.S.", "P.P.S"])
        return (f"At the end of your response, please add a postscript starting with {m}",
                {"postscript_marker": m})
    if iid == "detectable_format:number_bullet_lists":
        n = rng.randint(2, 5)
        return (f"Your answer must contain exactly {n} bullet points. Use markdown bullet points "
                "such as:\n* This is point 1.\n* This is point 2", {"num_bullets": n})
    if iid == "detectable_format:constrained_response":
        return ("Answer with one of the following options: (\"My answer is yes.\", \"My answer "
                "is no.\", \"My answer is maybe.\")", {})
    if iid == "detectable_format:number_highlighted_sections":
        n = rng.randint(1, 3)
        noun = "section" if n == 1 else "sections"
        return (f"Highlight at least {n} {noun} in your answer with markdown, i.e. "
                "*highlighted section*.", {"num_highlights": n})
    if iid == "detectable_format:multiple_sections":
        s, n = rng.choice(["Section", "SECTION"]), rng.randint(2, 4)
        return (f"Your response must have {n} sections. Mark the beginning of each section with "
                f"{s} X, such as:\n{s} 1\n[content of section 1]\n{s} 2\n[content of section 2]",
                {"section_spliter": s, "num_sections": n})
    if iid == "detectable_format:json_format":
        return ("Your entire output should be wrapped in JSON format. You can use markdown "
                "ticks such as ```.", {})
    if iid == "detectable_format:title":
        return ("Your answer must contain a title, wrapped in double angular brackets, such as "
                "<<poem of joy>>.", {})
    if iid == "combination:two_responses":
        return ("Give two different responses. Responses and only responses should be separated "
                "by 6 asterisk symbols: ******.", {})
    if iid == "combination:repeat_prompt":
        return ("First repeat the request word for word without change, then give your answer "
                "(1. do not say any words or characters before repeating the request; 2. the "
                "request you need to repeat does not include this sentence)",
                {"prompt_to_repeat": task})
    if iid == "startend:end_checker":
        p = rng.choice(END_PHRASES)
        return (f"Finish your response with this exact phrase: {p} No other words should follow "
                "this phrase.", {"end_phrase": p})
    if iid == "startend:start_checker":
        p = rng.choice(START_PHRASES)
        return f"Start your response with the words \"{p}\".", {"start_phrase": p}
    if iid == "change_case:capital_word_frequency":
        rel = rng.choice(REL)
        n = rng.randint(2, 5)
        return (f"In your response, words with all capital letters should appear {rel} {n} "
                "times.", {"capital_frequency": n, "capital_relation": rel})
    if iid == "change_case:english_capital":
        return "Your entire response should be in English, and in all capital letters.", {}
    if iid == "change_case:english_lowercase":
        return ("Your entire response should be in English, and in all lowercase letters. No "
                "capital letters are allowed.", {})
    if iid == "punctuation:no_comma":
        return "In your entire response, refrain from the use of any commas.", {}
    if iid == "startend:quotation":
        return "Wrap your entire response with double quotation marks.", {}
    raise ValueError(iid)


def main():
    rng = random.Random(20261201)
    rows = []
    tasks = list(TASKS)
    questions = list(QUESTIONS)
    for i in range(len(TASKS) + len(QUESTIONS)):
        # Each prompt leads with one kind in turn, so every kind is used several times.
        primary = ALL[i % len(ALL)]
        if primary == "detectable_format:constrained_response":
            task = questions.pop(0) if questions else tasks.pop(0)
        else:
            task = tasks.pop(0) if tasks else questions.pop(0)
        chosen = [primary]
        extra = rng.choice([0, 1, 1, 2])
        candidates = [k for k in ALL if k not in CONFLICTS[primary]]
        rng.shuffle(candidates)
        for c in candidates:
            if len(chosen) > extra:
                break
            if all(c not in CONFLICTS[x] for x in chosen):
                chosen.append(c)
        # The repeated request must be the prompt's first text.
        order = sorted(chosen, key=lambda k: ALL.index(k))
        parts, kwargs = [], []
        for k in order:
            text, kw = build(k, rng, task)
            parts.append(text)
            kwargs.append(kw)
        # A description that shows a multi-line example ends its line.
        prompt = task
        for part in parts:
            prompt += ("\n" if "\n" in prompt else " ") + part
        rows.append({
            "key": 1000 + i,
            "prompt": prompt,
            "instruction_id_list": order,
            "kwargs": kwargs,
        })
    for r in rows:
        print(json.dumps(r, ensure_ascii=False))


if __name__ == "__main__":
    main()
